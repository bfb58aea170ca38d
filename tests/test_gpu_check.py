"""scripts/gpu_check.sh's CPU dry run: every step of the GPU check at toy sizes, proving the script works end to
end on a machine without a GPU (the real check runs on one). Marked slow: run it with `python -m pytest -m slow
tests/test_gpu_check.py` before a GPU session."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow  # ~2 minutes: the whole GPU script at toy sizes on the CPU (run with -m slow before a GPU session)
def test_gpu_check_dry_run(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHON": sys.executable,
                                                                          "PATH": "/usr/bin:/bin",
                                                                          "OMP_NUM_THREADS": "1"}, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in (tmp_path / "tests.log").read_text()
    assert "passed" in (tmp_path / "tests_cascade.log").read_text()
    assert (tmp_path / "cost_curve_tiny.csv").read_text().startswith("tree_tokens,seconds")
    assert "device=cpu" in (tmp_path / "environment.txt").read_text()
    assert "ms per step" in (tmp_path / "decode_profile.md").read_text()
    timing = json.loads((tmp_path / "attention" / "attention_timing.json").read_text())
    for model in ("tiny", "reference"):  # sdpa beside cascade attention (its pure-torch kernel: no flash-attn here)
        by_attn = timing["results"][model]
        assert set(by_attn) == {"sdpa", "treespec_cascade_torch"}
        for entry in by_attn.values():
            assert entry["ratios"]["32"]["1"] == 1.0 and entry["decode"]["vanilla"]["tokens_per_s"] > 0
    # the same drafts and trees accept the same tokens under either implementation (greedy: the same output)
    assert by_attn["sdpa"]["decode"]["eagle, full 2×3"]["tau"] == \
        by_attn["treespec_cascade_torch"]["decode"]["eagle, full 2×3"]["tau"]
    assert "pure-torch kernel" in (tmp_path / "attention" / "attention_timing.md").read_text()

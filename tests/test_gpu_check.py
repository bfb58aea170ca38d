"""scripts/gpu_check.sh's CPU dry run: every step of the GPU check at toy sizes, proving the script works end to
end on a machine without a GPU (the real check runs on one). Marked slow: run it with `python -m pytest -m slow
tests/test_gpu_check.py` before a GPU session."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~10 s: the whole GPU script at toy sizes on the CPU (run with -m slow before a GPU session)
def test_gpu_check_dry_run(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHON": sys.executable,
                                                                          "PATH": "/usr/bin:/bin",
                                                                          "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in (tmp_path / "tests.log").read_text()
    assert (tmp_path / "cost_curve_tiny.csv").read_text().startswith("tree_tokens,seconds")
    assert "device=cpu" in (tmp_path / "environment.txt").read_text()

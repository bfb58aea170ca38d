"""Comparison runs set side by side (train/compare/side_by_side.py; the job's ``report=`` and ``compare=`` modes,
scripts/compare_trees.py) and the stamp that tells them apart (train/compare/stamp.py): where the stamps differ,
the configurations every run measured, paths given with a comma. No model runs."""

import importlib.util
import json
import runpy
import sys

import pytest
import torch

from treespec.train.compare import report
from treespec.train.compare.job import run_job
from treespec.train.compare.stamp import collect, flatten, prompts_digest

from tests.helpers import REPORT_PLAN, ROOT, compose_cfg, rendered_run, synthetic_result, tiny_llama


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One synthetic run written and rendered once (the figures take a second or two)."""
    return rendered_run(tmp_path_factory.mktemp("run"))


# ------------------------------------------------------------------------------------------- re-render, compare

def test_report_and_compare_modes_of_the_job(rendered, tmp_path):
    _, _, out = rendered
    other = tmp_path / "other"
    other.mkdir()
    b = synthetic_result(seed=1, prompts=6, commit="9" * 40)
    b["stamp"]["device"]["torch_threads"] = 1
    report.write_outputs(b, other, figures=False)
    job = run_job(compose_cfg("compare", [f"compare=[{out},{other}]", "logger=none"]), tmp_path / "cmp")
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert job["mode"] == "compare" and text == job["markdown"]
    differ = text.split("## Where the stamps differ")[1].split("##")[0]
    assert "git.commit" in differ and "device.torch_threads" in differ and "settings.prompts" in differ
    assert "versions.torch" not in differ
    assert all(f"| {d} |" in text for d in REPORT_PLAN)
    common = text.split("## Configurations measured in every run")[1]
    assert all(f"| {c['config'].replace('|', '/')} |" in common for c in b["records"])
    assert "nan" not in text.lower()
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    (copy_dir / "results.json").write_text((out / "results.json").read_text())
    job = run_job(compose_cfg("compare", [f"report={copy_dir}", "logger=none"]), tmp_path / "unused")
    assert job["mode"] == "report" and (copy_dir / "results.md").read_text() == (out / "results.md").read_text()
    assert not (tmp_path / "unused").exists()
    with pytest.raises(ValueError, match="not both"):
        run_job(compose_cfg("compare", [f"report={out}", f"compare=[{out},{other}]"]), tmp_path)
    with pytest.raises(FileNotFoundError, match="no results.json"):
        report.rerender(tmp_path / "nowhere")


def _script():
    spec = importlib.util.spec_from_file_location("compare_trees", ROOT / "scripts" / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_paths_given_with_a_comma_reach_hydra_as_a_list(rendered, tmp_path, monkeypatch):
    quote = _script().quote_compare_paths
    assert quote(["compare=runs/a,runs/b", "logger=none"]) == ["compare=['runs/a','runs/b']", "logger=none"]
    assert quote(["compare=[a,b]", "report=x"]) == ["compare=[a,b]", "report=x"]
    _, _, out = rendered
    # the script as python runs it (in this process: a new interpreter would spend seconds importing torch)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["scripts/compare_trees.py", f"compare={out},{out}", "logger=none",
                                      f"run_dir={tmp_path / 'cmp'}"])
    runpy.run_path(str(ROOT / "scripts" / "compare_trees.py"), run_name="__main__")
    assert "Nothing but the start time" in (tmp_path / "cmp" / "comparison.md").read_text()


# ------------------------------------------------------------------------------------------- the stamp

def test_stamp_names_code_versions_device_weights_and_prompts():
    target = tiny_llama(seed=0)
    prompts = [torch.arange(5)[None], torch.arange(3)[None]]
    stamp = collect(target=target, prompts=prompts, prompt_set="test", command="python x.py a=1",
                    config={"a": 1}, seed=3)
    assert stamp["command"] == "python x.py a=1" and stamp["seed"] == 3 and stamp["config"] == {"a": 1}
    assert stamp["git"]["commit"] is None or len(stamp["git"]["commit"]) == 40
    assert {"treespec", "torch", "transformers"} <= set(stamp["versions"])
    assert stamp["device"]["torch_threads"] == torch.get_num_threads()
    assert len(stamp["target"]["weights_sha1"]) == 40
    assert stamp["prompts"]["token_ids_sha1"] == prompts_digest(prompts) != prompts_digest(prompts[::-1])
    json.dumps(stamp)
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": "1", "a.c": "[1, 2]", "d": "{}"}

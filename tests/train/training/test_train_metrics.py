"""τ as the training metric and a drafter run a researcher can read (train/training/expected_tau.py,
train/training/run_summary.py)."""

import json
import shlex

import pytest
import torch

from treespec.dynamic_tree import DynamicTree
from treespec.heads import registry
from treespec.heads.checkpoints.export import CONSUMERS, formats
from treespec.heads.eagle3 import Eagle3Model
from treespec.train.training import run_summary
from treespec.train.training.expected_tau import against_measured, expected_taus, tau_metrics
from treespec.tree import Tree

from tests.helpers import compose_cfg, tiny_llama, wandb_run_contains

ACC = [[0.5, 0.2], [0.4, 0.1]]


def test_expected_tau_by_hand():
    tau = expected_taus(ACC)
    assert tau["chain"] == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    # only 6 rank paths exist: the "16-node" tree is all of them, 1 + Σ_r0 acc0 + Σ_(r0,r1) acc0·acc1
    assert tau["tree16"] == pytest.approx(1 + 0.7 + 0.7 * 0.5)
    metrics = tau_metrics(ACC)
    assert metrics == pytest.approx({"eval/expected_tau_chain": tau["chain"], "eval/expected_tau_tree16": tau["tree16"],
                                     "eval/acc_depth_1": 0.5, "eval/acc_depth_2": 0.4})


def test_measured_tau_is_set_beside_the_expected_one():
    tree16 = expected_taus(ACC)["tree16"]
    entries, lines = against_measured(ACC, 1.9, Tree.chain(2), 1.6)
    assert entries == pytest.approx({"eval_tau_tree16": 1.9, "expected_tau_error": 1.9 / tree16 - 1,
                                     "expected_tau_eval_tree": 1.7})
    assert lines[0].startswith("6-node accuracy tree: measured 1.90, expected 2.05") and "within ~10 %" in lines[0]
    assert lines[1] == "evaluation tree (2 nodes): measured 1.60, expected 1.70 (-5.9%)"
    # a dynamic tree is grown per step: measured only
    entries, lines = against_measured(ACC, 1.9, DynamicTree(16, 5, 4), 2.0)
    assert "expected_tau_eval_tree" not in entries and "not predicted" in lines[1]
    assert "not predicted" not in against_measured(ACC, 1.9, Tree.chain(3), 2.0)[1][1].split(":")[0]


def test_duplicate_aux_layers_warn_with_the_layers_and_the_reason():
    eagle3, eagle, medusa = (registry.get(name) for name in ("eagle3", "eagle", "medusa"))
    warning = run_summary.duplicate_layers_warning(eagle3, (1, 1, 1), 2)
    assert "(1, 1, 1)" in warning and "2-layer target" in warning and "drafter.aux_layers" in warning
    assert run_summary.duplicate_layers_warning(eagle3, (2, 3, 4), 7) is None
    assert "drafter.feature_layers" in run_summary.duplicate_layers_warning(eagle, (1, 1, -1), 2)  # -1 = 2: fine
    assert run_summary.duplicate_layers_warning(medusa, (), 2) is None


def test_each_kind_names_its_in_training_top1():
    """The in-training top-1 a run's summary shows is the kind's own metric, with what it counts."""
    lines = run_summary.top1_lines(registry.get("eagle3"), {"eagle3_top1_0": 0.5, "depth1_top1": 0.9}, {}, None)
    assert lines == ["0.500 in training (val/eagle3_top1_0: step 0, teacher forced on the validation windows, only "
                     "positions whose target token is in the draft vocabulary, against the target's argmax over "
                     "that vocabulary)"]
    assert run_summary.top1_lines(registry.get("medusa"), {"depth1_top1": 0.25}, {}, None)[0].startswith("0.250")
    assert run_summary.top1_lines(registry.get("prompt_lookup"), {"top1": 0.3}, {}, None) == []


def test_resume_command_drops_stop_after_and_keeps_the_run():
    cmd = run_summary.resume_command(["drafter=eagle3", "trainer.stop_after=15", "resume=false", "run_dir=runs/x y"],
                                     "ignored")
    assert shlex.split(cmd) == ["python", "scripts/train_heads.py", "drafter=eagle3", "run_dir=runs/x y", "resume=true"]
    cmd = run_summary.resume_command(["drafter=eagle3"], "runs/heads/eagle3", world_size=4)
    assert cmd == "torchrun --nproc_per_node=4 scripts/train_heads.py drafter=eagle3 run_dir=runs/heads/eagle3 " \
                  "resume=true"
    assert "train_heads.py <the run's other overrides> run_dir=runs/a resume=true" in \
        run_summary.resume_command(None, "runs/a")


def test_resume_command_under_hydra_repeats_the_command_line():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from tests.helpers import CONF

    assert run_summary.hydra_overrides() is None  # a config composed in code
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train_heads", ["drafter=eagle", "trainer.stop_after=3"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        overrides = run_summary.hydra_overrides()
    finally:
        HydraConfig.instance().cfg = None
    assert overrides == ["drafter=eagle", "trainer.stop_after=3"]
    assert run_summary.resume_command(overrides, cfg.run_dir) == \
        "python scripts/train_heads.py drafter=eagle run_dir=runs/heads/eagle resume=true"


@pytest.mark.parametrize("target", ["reference:target", "/models/mine"])
def test_compare_command_composes(target):
    """The printed command is what conf/compare.yaml takes: the trained folder becomes the drafter's source."""
    cmd = shlex.split(run_summary.compare_command("eagle3", "runs/heads/eagle3/final", target))
    assert cmd[:2] == ["python", "scripts/compare_trees.py"]
    cfg = compose_cfg("compare", cmd[2:])
    assert list(cfg.drafters) == ["eagle3"] and cfg.available.eagle3.source == "runs/heads/eagle3/final"
    assert cfg.target == target


def test_export_formats_name_what_applies():
    target = tiny_llama(layers=7)
    reasons = formats(Eagle3Model(target), target)
    assert list(reasons) == list(CONSUMERS)
    assert {to for to, reason in reasons.items() if reason is None} == {"sglang", "vllm", "speculators", "eagle"}
    assert "Medusa" in reasons["medusa"]
    lines = run_summary.export_lines(reasons, "runs/x/final", "reference:target")
    assert "scripts/export_drafter.py runs/x/final --to sglang" in lines[0] and lines[1].startswith("not medusa")


def test_training_run_logs_expected_tau_and_ends_readably(tmp_path, tiny_trained_target, capsys):
    from treespec.train.training import drafter_job as train_heads

    target_dir, cache = tiny_trained_target  # 2 layers: EAGLE-3's aux layers are (1, 1, 1)
    run_dir = tmp_path / "run"
    common = ["debug=tiny_heads", "drafter=eagle3", "drafter.unroll_steps=2", "drafter.accuracy_depth=4",
              f"target={target_dir}", cache, f"run_dir={run_dir}"]
    capsys.readouterr()
    train_heads.run(compose_cfg("train_heads", [*common, "trainer.stop_after=25"]))
    out = capsys.readouterr().out
    assert "fuses target hidden state(s) 1 more than once (layers (1, 1, 1))" in out
    assert "stopped at step 25 of 60" in out
    assert f"run_dir={run_dir} resume=true" in out and "stop_after" not in out.split("resume")[-1]

    summary = train_heads.run(compose_cfg("train_heads", [*common, "resume=true"]))
    out = capsys.readouterr().out
    assert f"{run_dir}/final (the trained drafter" in out
    assert f"scripts/compare_trees.py 'drafters=[eagle3]' available.eagle3.source={run_dir}/final" in out
    assert "eval/acc_depth_1" in out and "head_accuracy.json" in out and "val/eagle3_top1_0" in out
    assert "vllm" in out and "within ~10 % on chains" in out

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    evals = [(r["step"], r["metrics"]) for r in rows if "eval/expected_tau_chain" in r.get("metrics", {})]
    assert [s for s, _ in evals] == [20, 40, 60]  # eval_every 20; the resumed run logs the later ones
    for _, m in evals:
        accs = [m[f"eval/acc_depth_{k}"] for k in range(1, 5)]
        assert all(0 <= a <= 1 for a in accs) and "eval/acc_depth_5" not in m
        assert 1 <= m["eval/expected_tau_chain"] <= 5 and m["eval/expected_tau_chain"] <= m["eval/expected_tau_tree16"]
    assert summary["expected_tau_tree16"] == pytest.approx(evals[-1][1]["eval/expected_tau_tree16"])
    # the end-of-run decoding on the 16-node accuracy tree of the last accuracies, beside its expected τ
    assert 1 <= summary["eval_tau_tree16"] <= 5
    assert summary["expected_tau_error"] == pytest.approx(summary["eval_tau_tree16"] / summary["expected_tau_tree16"]
                                                          - 1)
    assert "accuracy tree: measured" in out and "DynamicTree(total_tokens=16, depth=5, top_k=4)): measured" in out
    assert (run_dir / "expected_tau.png").is_file()

    # the decoding evaluation's acceptance lengths: scalars and a table beside the histogram
    last = {k: v for r in rows if r["step"] == 60 for k, v in r.get("metrics", {}).items()}
    assert last["eval/measured_tau"] == pytest.approx(summary["eval_mean_accept_length"])
    shares = [v for k, v in last.items() if k.startswith("eval/accept_length_share_")]
    assert shares and sum(shares) == pytest.approx(1.0)
    table = next(r["table"]["eval/accept_lengths"] for r in rows if "table" in r)
    assert table["columns"] == ["prompt", "pass", "accept_length"]
    assert len(table["data"]) == last["eval/verification_passes"]
    assert sum(n for _, _, n in table["data"]) / len(table["data"]) == pytest.approx(last["eval/measured_tau"])
    assert "export/depth1_top1" in last and summary["export_formats"]["medusa"] != "ok"
    assert wandb_run_contains(run_dir, "eval/expected_tau_tree16") and wandb_run_contains(run_dir, "accept_lengths")
    assert torch.isfinite(torch.tensor(summary["expected_tau_chain"]))

"""The shipped smoke configs, chained as a user runs them: a tiny LM (``debug=tiny_lm``: the one the
``tiny_trained_target`` fixture trains once per process, tests/conftest.py), then tiny drafters of two kinds on
it (``debug=tiny_heads``: heads and a feature drafter), then a comparison of them on that LM. Each step reads what
the step before wrote (the exported model, the drafters' folders with their rank accuracies), so a crash at
the end of one (rank accuracies a hair above 1 once refused every accuracy-grown tree) fails here."""

import json

import pytest

from treespec.heads.training.accuracy import RankHits
from treespec.planning.analysis import grow_tree
from treespec.sampling import GREEDY
from treespec.train.compare import job as compare
from treespec.train.training import data
from treespec.train.training import drafter_job as train_heads
from treespec.train.training.checkpoint import CheckpointMismatch

from tests.helpers import compose_cfg

DRAFTERS = ("medusa", "eagle3")  # heads and a feature drafter (each kind's own training test trains the others)


def test_rank_accuracies_that_cover_every_position_grow_trees():
    """247/248 + 1/248 summed in float32 is 1 + 4e-9: the accuracy row of a depth whose top 2 always hold the
    target's token. Counted in float64 and clamped it sums to at most 1, and a tree grows from it."""
    import torch

    hits = RankHits(1, 2, GREEDY)
    target_logits = torch.zeros(248, 4)
    target_logits[:, 1] = 1.0  # the target's token is 1 everywhere
    candidates = torch.tensor([[1, 0]] * 247 + [[0, 1]])  # rank 0 right 247 times, rank 1 once
    hits.add(0, candidates, target_logits)
    acc = hits.table()
    assert sum(acc[0]) <= 1.0 and acc[0][0] == 247 / 248
    assert len(grow_tree(acc, 2)) == 2
    assert len(grow_tree([[247 / 248 + 1e-8, 1 / 248]], 2)) == 2  # a file written before the fix still grows


def test_tiny_lm_then_tiny_heads_then_a_comparison(tmp_path, monkeypatch, tiny_trained_target):
    # the comparison reads the stdlib corpus (FR-Spec's token counts, REST's index): a few files of it, not all of it
    monkeypatch.setattr(data, "STDLIB_CORPUS", {**data.STDLIB_CORPUS, "max_files": 12})
    target, cache = tiny_trained_target

    small = ["debug=tiny_heads", f"target={target}", cache, "logger=none", "trainer.max_steps=4",
             "trainer.eval_every=4", "trainer.ckpt_every=4", "trainer.eval_windows=2", "data.self_distill.prompts=8",
             "data.self_distill.new_tokens=16", "eval.prompts=1", "eval.max_new_tokens=8"]
    for name in DRAFTERS:
        summary = train_heads.run(compose_cfg("train_heads", [*small, f"drafter={name}", f"run_dir={tmp_path / name}"]))
        accuracy = json.loads((tmp_path / name / "final" / "head_accuracy.json").read_text())
        assert all(0 <= sum(row) <= 1 for row in accuracy), name
        assert summary["eval_mean_accept_length"] >= 1.0
    # a resume on other self-distillation data is another run: refused, naming the setting
    with pytest.raises(CheckpointMismatch, match=r"data.self_distill.prompts differs \(.*saved 8, now 4\)"):
        train_heads.run(compose_cfg("train_heads", [*small, "drafter=medusa", f"run_dir={tmp_path / 'medusa'}",
                                                    "resume=true", "data.self_distill.prompts=4"]))

    cfg = compose_cfg("compare", [
        f"target={target}", f"drafters=[{','.join(DRAFTERS)}]", "logger=none", "prompts=1", "max_new_tokens=8",
        "cost_sizes=[1,2]", "peers=false", "workload.held_out=1", "assistant=null", f"paths.data={tmp_path / 'cache'}",
        "trees=[{kind: chain, depth: 2}, {kind: accuracy, nodes: 4}, {kind: auto, max_nodes: 4}]",
        *(f"available.{name}.source={tmp_path / name / 'final'}" for name in DRAFTERS)])
    result = compare.run_from_config(cfg, tmp_path / "compare")
    measured = {r["drafter"] for r in result["records"]}
    assert set(DRAFTERS) <= measured and result["complete"]
    assert (tmp_path / "compare" / "results.md").is_file()

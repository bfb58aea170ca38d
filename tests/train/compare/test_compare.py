"""The tree-comparison harness (train/compare/harness.py, train/compare/job.py): a tiny comparison writes its tables,
figures and wandb run; across batch sizes; the trees a config expands to and those a drafter cannot fill; bad specs
named; the rows handed over after every prompt, and a killed run's partial results.json; acceptance rules side by
side. What it predicts and how tree=auto chooses: tests/train/compare/test_compare_predictions.py."""

import csv
import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from treespec.heads import DraftModel, PromptLookup
from treespec.heads.draft_model.drafter import rank_accuracy as draft_model_accuracy
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.eagle.drafter import rank_accuracy as depth_rank_accuracy
from treespec.planning.autotree import (
    CostModel,
    EngineCost,
    choose_tree,
    cost_at,
    predict,
    predict_generation,
)
from treespec.planning.bench import Config, measure
from treespec.planning.tree_spec import build_tree
from treespec.timing import median_time
from treespec.train.compare.configurations import DrafterSpec, expand_specs
from treespec.train.compare.harness import run_comparison
from treespec.train.compare.job import run_from_config, run_job
from treespec.train.compare.job_config import check_config
from treespec.train.compare.report import rerender
from treespec.train.training.log import RunLogger
from treespec.tree import Tree

from tests.helpers import CONF, compose_cfg, perturbed, tiny_llama, wandb_run_contains


def test_expand_specs():
    specs = expand_specs([{"kind": "chain", "depth": [1, 2]}, {"kind": "full", "width": [2, 3], "depth": 2},
                          {"kind": "paths", "paths": [[0], [1]]}])
    assert [s.get("depth") for s in specs] == [1, 2, 2, 2, None] and specs[-1]["paths"] == [[0], [1]]


def test_sampled_candidates_skip_dynamic_trees():
    from treespec.train.compare.configurations import resolve_tree

    target = tiny_llama(seed=0)
    sampled = DrafterSpec("eagle:sample", Eagle(EagleModel(target), candidates="sample"))
    tree, reason = resolve_tree({"kind": "dynamic", "total_tokens": 4, "depth": 2, "top_k": 2}, sampled, {1: 1.0}, 8)
    assert tree is None and "samples its candidates" in reason
    tree, reason = resolve_tree({"kind": "chain", "depth": 3}, sampled, {1: 1.0}, 8)
    assert len(tree) == 3 and reason is None


def test_bad_tree_spec_in_config_is_named(tmp_path):
    conf = CONF
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="compare", overrides=["trees=[{kind: full, width: 0, depth: 2}]", "logger=none"])
    with pytest.raises(ValueError, match=r"bad tree spec \{'kind': 'full', 'width': 0, 'depth': 2\}"):
        run_from_config(cfg, tmp_path)


@pytest.mark.parametrize("trees, drafters, message", [
    # a tree or drafter given twice failed deep in the timing ("zip() argument 2 is shorter than argument 1"); two
    # "auto" entries with different max_nodes were reported under one name
    ([{"kind": "chain", "depth": 2}, {"kind": "chain", "depth": 2}], ["pl"], r"are both configuration 'chain γ=2'"),
    ([{"kind": "chain", "depth": [2, 2]}], ["pl"], r"are both configuration 'chain γ=2': give each tree once"),
    ([{"kind": "auto", "drafters": ["pl"], "max_nodes": 8}, {"kind": "auto", "drafters": ["pl"], "max_nodes": 16}],
     ["pl"], r"both configuration 'auto across pl': give each tree once \(one 'auto' per run"),
    ([{"kind": "chain", "depth": 2}], ["pl", "pl"], r"drafters: pl named twice"),
])
def test_a_tree_or_drafter_given_twice_is_refused_before_anything_runs(tmp_path, trees, drafters, message):
    with pytest.raises(ValueError, match=message):
        run_comparison(tiny_llama(), [DrafterSpec(name, PromptLookup()) for name in drafters], trees,
                       [torch.tensor([[1, 2, 3]])], max_new_tokens=4, peers=False, out_dir=tmp_path / "run",
                       log=lambda *_: None)
    assert not (tmp_path / "run").exists()
    cfg = compose_cfg("compare", ["logger=none", "drafters=[suffix,suffix]"])
    with pytest.raises(ValueError, match=r"drafters: suffix named twice"):
        check_config(cfg)


def test_tiny_comparison_writes_tables_plots_and_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)  # close to the target: some candidates are accepted
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    eagle = EagleModel(target).eval()
    eagle_drafter = Eagle(eagle)
    drafters = [DrafterSpec("draft", DraftModel(draft), draft_model_accuracy(target, draft, windows, depth=3, top_k=3)),
                DrafterSpec("prompt_lookup", PromptLookup()),
                DrafterSpec("eagle", eagle_drafter, depth_rank_accuracy(target, eagle, windows, depth=3, top_k=3),
                            draft_cost_per_depth=median_time(Eagle(eagle).drafting_step(past_len=8)),
                            drafting_step=lambda: eagle_drafter.drafting_step(past_len=8))]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    logger = RunLogger(tmp_path, use_wandb=True, name="tiny-compare")
    result = run_comparison(target, drafters, [{"kind": "chain", "depth": 2}, {"kind": "accuracy", "nodes": 3}],
                            prompts, max_new_tokens=6, cost_sizes=(1, 2, 4), assistant=draft, out_dir=tmp_path,
                            logger=logger, log=lambda *_: None)
    logger.finish()
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    # vanilla + draft × 2 trees + prompt lookup × chain (it has no accuracies for an accuracy tree) + eagle × 2
    assert [r["config"] for r in rows] == ["vanilla", "draft | chain γ=2", "draft | accuracy 3",
                                           "prompt_lookup | chain γ=2", "eagle | chain γ=2", "eagle | accuracy 3"]
    assert float(rows[0]["tau"]) == 1.0 and float(rows[1]["tau"]) > 1.0 and rows[2]["predicted_tau"] != "nan"
    assert rows[-1]["predicted_tau"] != "nan"
    assert {p["name"] for p in result["peers"]} >= {"transformers greedy", "transformers assisted"}
    for name in ("results.md", "summary.csv", "cost_curve.csv", "tau_vs_nodes.png", "speedup_vs_nodes.png",
                 "accept_length_hist.png", "acceptance_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    # per-prompt values for the intervals, each drafter's best beside the peers, a stamp, no "nan" anywhere
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["complete"] is True and saved["prompts_done"] == 2
    assert saved["prompt_of_run"] == [0, 1] and all(len(r["runs"]["speedup"]) == 2 for r in saved["records"])
    bests = {max((r for r in saved["records"] if r["drafter"] == d), key=lambda r: r["speedup"])["config"]
             for d in ("draft", "prompt_lookup", "eagle")}
    assert set(saved["peer_pass"]) == {"vanilla"} | bests
    assert saved["skipped"] == [{"config": "prompt_lookup | accuracy 3", "drafter": "prompt_lookup",
                                 "tree": "accuracy 3", "reason": "prompt_lookup has no measured accuracies"}]
    assert set(saved["accuracy"]) == {"draft", "eagle"}
    # EAGLE's predictions use its own curve, timed after its drafting calls, against vanilla's target-alone cost,
    # and the engine's own cost per step: one cost model, kept in results.json
    after = {int(n): t for n, t in saved["cost_curves_after_drafting"]["eagle"].items()}
    assert set(saved["cost_curves_after_drafting"]) == {"eagle"} and {1, 2, 4} <= set(after)
    # and at the size of every tree it verifies (root included), not interpolated
    assert {r["nodes"] + 1 for r in saved["records"] if r["drafter"] == "eagle" and r["nodes"]} <= set(after)
    costs = CostModel.from_record(saved["cost_models"]["eagle"])
    engine = EngineCost.from_record(saved["engine"])
    assert costs.curve == after and costs.draft_cost_per_depth == drafters[2].draft_cost_per_depth
    assert costs.baseline == saved["cost_curve"]["1"] and costs.engine == engine
    record = next(r for r in saved["records"] if r["config"] == "eagle | chain γ=2")
    expected = predict(Tree.chain(2), saved["accuracy"]["eagle"], costs)
    assert record["predicted_decode_speedup"] == pytest.approx(expected.speedup)
    assert expected.vanilla == pytest.approx(saved["cost_curve"]["1"] + engine.vanilla)
    assert expected.step_cost == pytest.approx(cost_at(after, 3) + 2 * drafters[2].draft_cost_per_depth
                                               + engine.fixed + 3 * engine.per_node)
    assert record["predicted_step_ms"] == pytest.approx(1e3 * expected.step_cost)
    # the prediction beside a measured speedup is of whole generations: the prefill at each prompt's length
    # (interpolated on the measured prefill curve) and its generation length (6 tokens: no end tokens here), which
    # speculation does not shorten: it pulls the prediction towards 1
    prefill = {int(n): t for n, t in saved["prefill_curve"].items()}
    assert set(prefill) == {10}
    whole = predict_generation(expected, 10, 6, prefill)
    assert record["predicted_speedup"] == pytest.approx(whole) and abs(whole - 1) < abs(expected.speedup - 1)
    # every configuration's tree is saved, the best one as best_tree.json, and results.md says how to use it
    for rec in saved["records"][1:]:
        assert Tree.load(tmp_path / rec["tree_file"]) == build_tree(rec["tree_spec"])
    best = next(r for r in saved["records"] if r["config"] == saved["best"])
    assert Tree.load(tmp_path / "best_tree.json") == Tree.load(tmp_path / best["tree_file"])
    assert list(csv.DictReader(open(tmp_path / "cost_curve.csv")))[0].keys() == {"tree_tokens", "seconds",
                                                                                 "after_eagle"}
    stamp = saved["stamp"]
    assert stamp["drafters"]["prompt_lookup"]["weights"] is None
    assert len(stamp["drafters"]["draft"]["weights_sha1"]) == 40
    md = (tmp_path / "results.md").read_text()
    assert "nan" not in md.lower() and "## Summary" in md and stamp["target"]["weights_sha1"][:12] in md
    assert "partial run" not in md and "| draft ms/depth | c |" in md
    # predicted ÷ measured on every predicted row, and its median over them (scripts/prediction_error.py prints it)
    rows_md = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| eagle | ")}
    ratio = record["predicted_speedup"] / record["speedup"]
    assert "| pred ÷ meas |" in md and f"| {ratio:.2f} |" in rows_md["chain γ=2"]
    assert float(next(r for r in rows if r["config"] == "eagle | chain γ=2")["predicted_over_measured"]) == \
        pytest.approx(ratio)
    assert "median |predicted ÷ measured − 1| = " in md
    assert "## By category" in md and "| all speedup | all τ |" in md and "best_tree.json" in md
    assert wandb_run_contains(tmp_path, "accept_length/draft | chain")
    for key in ("compare/summary", "compare/results", "compare/peers", "compare/speedup_vs_nodes",
                "compare/acceptance_heatmap"):
        assert wandb_run_contains(tmp_path, key), key


def test_tiny_comparison_across_batch_sizes(tmp_path):
    """batch_sizes: every drafter × tree at each batch size against batched vanilla and transformers' batched
    generate, tree=auto per batch size, the batch table, csv and figure; the report re-renders from results.json."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    drafters = [DrafterSpec("draft", DraftModel(draft), draft_model_accuracy(target, draft, windows, depth=3, top_k=3),
                            draft_cost_per_depth=1e-4),
                DrafterSpec("prompt_lookup", PromptLookup())]
    prompts = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 11, 3)]
    result = run_comparison(target, drafters, [{"kind": "chain", "depth": 2}, {"kind": "auto", "max_nodes": 4}],
                            prompts, max_new_tokens=5, cost_sizes=(1, 2, 4), peers=False, out_dir=tmp_path,
                            log=lambda *_: None, batch_sizes=[1, 2], batches=2, batch_cost_sizes=(1, 2, 4))
    section = result["batch"]
    assert section["batch_sizes"] == [1, 2] and set(section["cost_curves"]) == {"1", "2"}
    names = {(r["batch_size"], r["config"]) for r in section["records"]}
    for size in (1, 2):
        assert {(size, "vanilla"), (size, "transformers batched"), (size, "draft | chain γ=2"),
                (size, "draft | auto"), (size, "prompt_lookup | chain γ=2")} <= names
    # batches=2, or as many as hold every one of the 3 prompts once: 3 at B = 1
    assert section["batches_by_size"] == {"1": 3, "2": 2}
    assert all(len(r["runs"]["speedup"]) == len(r["runs"]["speedup_vs_transformers"]) == (3 if r["batch_size"] == 1
                                                                                          else 2)
               for r in section["records"])
    auto = [r for r in section["records"] if r["config"] == "draft | auto"]
    assert all(0 <= r["nodes"] <= 4 for r in auto)  # chosen per batch size; 0 is the empty tree (vanilla)
    # chosen per batch size from that size's curve, drafting costs and engine cost (one CostModel)
    assert set(section["engines"]) == {"1", "2"}
    for r in auto:
        size = str(r["batch_size"])
        fixed, per_depth, per_node = section["draft_costs"]["draft"][size]
        costs = CostModel({int(n): t for n, t in section["cost_curves"][size].items()}, fixed, per_depth,
                          engine=EngineCost.from_record(section["engines"][size]), draft_cost_per_node=per_node)
        assert len(choose_tree(drafters[0].accuracy, costs, max_nodes=4)[0].tree) == r["nodes"]
    assert {s["config"] for s in section["skipped"]} == {"prompt_lookup | auto"}  # no accuracies to grow from
    # whole generations predicted at each B (per step beside), and the table of "auto" choices followed at B = 2
    chain = {r["batch_size"]: r for r in section["records"] if r["config"] == "draft | chain γ=2"}
    assert all(r["predicted_speedup"] > 0 and r["predicted_step_speedup"] > 0 for r in chain.values())
    per_b = [r for r in section["records"] if r["config"] == "draft | auto per B"]
    assert [r["batch_size"] for r in per_b] == [2] and set(per_b[0]["table"]) == {"1", "2"}
    assert set(section["prefill_curves"]) == {"1", "2"}
    md = (tmp_path / "batch.md").read_text()
    assert "| B | drafter | best tree |" in md and "Where speculation stops paying" in md and "nan" not in md.lower()
    assert "### Predicted against measured" in md and "Median |predicted ÷ measured − 1|: B = 1:" in md
    assert "## Batch sizes" in (tmp_path / "results.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "batch.csv")))
    assert {r["batch_size"] for r in rows} == {"1", "2"} and (tmp_path / "speedup_vs_batch.png").stat().st_size > 0
    (tmp_path / "batch.md").unlink()
    rerender(tmp_path)
    assert (tmp_path / "batch.md").read_text() == md


def test_measure_hands_over_the_rows_after_every_prompt():
    target = tiny_llama(seed=0)
    prompts = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    seen = []
    rows = measure(target, [Config("lookup", PromptLookup(), Tree.chain(2))], prompts, max_new_tokens=4,
                   warmup=False, on_prompt=seen.append)
    assert len(seen) == 3
    for k, partial in enumerate(seen, start=1):
        assert [r.name for r in partial] == ["vanilla", "lookup"]
        for r in partial:
            assert len(r.prompt_tokens_per_s) == len(r.prompt_speedups) == len(r.prompt_accept_lengths) == k
            assert r.new_tokens == 4 * k
    # each handover extends the one before, and the last is what measure returns
    final = {r.name: r for r in rows}
    for partial in seen:
        for r in partial:
            k = len(r.prompt_speedups)
            assert r.prompt_accept_lengths == final[r.name].prompt_accept_lengths[:k]
            assert r.prompt_tokens_per_s == final[r.name].prompt_tokens_per_s[:k]
    assert [r.prompt_speedups for r in seen[-1]] == [r.prompt_speedups for r in rows]


class Killed(Exception):
    pass


def test_a_killed_comparison_leaves_a_partial_results_json_that_renders(tmp_path):
    target = tiny_llama(seed=0)
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def log(text):  # vanilla then prompt lookup per prompt: the third run is the second prompt's first
        if text.strip().startswith("[3/4]"):
            raise Killed

    with pytest.raises(Killed):
        run_comparison(target, [DrafterSpec("prompt_lookup", PromptLookup())], [{"kind": "chain", "depth": 2}],
                       prompts, max_new_tokens=4, cost_sizes=(1, 2), peers=False, out_dir=tmp_path, log=log)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["complete"] is False and saved["prompts_done"] == 1 and saved["prompt_of_run"] == [0]
    assert [r["config"] for r in saved["records"]] == ["vanilla", "prompt_lookup | chain γ=2"]
    assert all(len(r["runs"][key]) == 1 for r in saved["records"] for key in r["runs"])
    assert saved["records"][1]["c"] is not None and saved["records"][0]["c"] is None
    assert not (tmp_path / "results.md").exists(), "the report is rendered only at the end or on report=PATH"
    job = run_job(compose_cfg("compare", [f"report={tmp_path}", "logger=none"]), tmp_path / "unused")
    assert "**partial run: 1 of 2 prompt runs measured**" in job["markdown"].splitlines()[2]
    assert (tmp_path / "speedup_vs_nodes.png").stat().st_size > 0


def test_acceptance_rules_side_by_side(tmp_path):
    """acceptance=[rejection, block, traversal]: one row per rule on the same trees, at T = 1; block skips the
    branching tree; a bad rule is named before anything is loaded."""
    from omegaconf import OmegaConf

    from treespec.train.compare.job_config import acceptance_rules

    target = tiny_llama(seed=0)
    drafters = [DrafterSpec("draft", DraftModel(perturbed(target, 0.05), candidates="sample"))]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))]
    result = run_comparison(target, drafters, [{"kind": "chain", "depth": 2}, {"kind": "full", "width": 2, "depth": 2}],
                            prompts, max_new_tokens=6, temperature=1.0, cost_sizes=(1, 2, 4), peers=False,
                            out_dir=tmp_path, log=lambda *_: None, acceptance=["rejection", "block", "traversal"])
    names = [r["config"] for r in result["records"]]
    assert sorted(names[1:]) == sorted(f"draft | {tree} | {rule}" for tree, rule in
                                       [("chain γ=2", "rejection"), ("chain γ=2", "block"), ("chain γ=2", "traversal"),
                                        ("full 2×2", "rejection"), ("full 2×2", "traversal")]), names
    assert [s["reason"] for s in result["skipped"]] == ["block verification verifies chains"]
    assert {r["acceptance"] for r in result["records"][1:]} == {"rejection", "block", "traversal"}
    assert acceptance_rules(OmegaConf.create({"acceptance": ["rejection", "traversal"]})) == ["rejection", "traversal"]
    with pytest.raises(ValueError, match="'greedy'"):
        acceptance_rules(OmegaConf.create({"acceptance": ["rejection", "greedy"]}))

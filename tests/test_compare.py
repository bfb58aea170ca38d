"""The tree-comparison harness: tree=auto follows the analysis, outputs are written, bad specs named."""

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from treespec import generate
from treespec.heads import DraftModel, PromptLookup, load_profile, registry
from treespec.heads.draft_model.drafter import rank_accuracy as draft_model_accuracy
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.eagle.drafter import rank_accuracy as depth_rank_accuracy
from treespec.planning.autotree import (
    CostModel,
    EngineCost,
    choose_tree,
    cost_at,
    measure_cost_curve,
    predict,
    predict_generation,
)
from treespec.planning.bench import Config, measure
from treespec.planning.tree_spec import build_tree
from treespec.timing import median_time
from treespec.train.compare.configurations import DrafterSpec, expand_specs
from treespec.train.compare.harness import run_comparison
from treespec.train.compare.job import run_from_config, run_job
from treespec.train.compare.report import rerender
from treespec.train.training.data import own_continuations
from treespec.train.training.log import RunLogger
from treespec.tree import Tree

from .helpers import compose_cfg, hf_greedy, perturbed, tiny_llama, wandb_run_contains

ACC = [[0.6, 0.15, 0.05], [0.45, 0.1, 0.05], [0.3, 0.1], [0.2, 0.05]]


def test_auto_picks_the_predicted_best_tree():
    flat = {1: 1.0, 8: 1.0, 64: 1.0}           # memory-bound: verifying more tokens is free
    steep = {1: 1.0, 8: 8.0, 64: 64.0}         # compute-bound: cost grows with every token
    best_flat, preds_flat = choose_tree(ACC, flat, max_nodes=20)
    best_steep, preds_steep = choose_tree(ACC, steep, max_nodes=20)
    assert best_flat.speedup == max(p.speedup for p in preds_flat)
    assert len(best_flat.tree) == 20            # free nodes only add expected tokens
    assert len(best_steep.tree) < 4 and best_steep.speedup == max(p.speedup for p in preds_steep)
    p = predict(best_steep.tree, ACC, steep)
    assert p.speedup == pytest.approx(p.tau * cost_at(steep, 1) / cost_at(steep, best_steep.tree.num_nodes))
    # a drafter that rarely agrees with the target: no tree beats vanilla, so "auto" drafts nothing
    best_poor, preds_poor = choose_tree([[0.05], [0.01]], {1: 1.0, 8: 1.2}, max_nodes=8, draft_cost_per_depth=0.3)
    assert len(best_poor.tree) == 0 and best_poor.speedup == 1.0 and len(preds_poor) == 3  # 0, 1 and 2 nodes
    assert all(p.speedup < 1.0 for p in preds_poor[1:])
    # the empty tree is vanilla decoding whatever the drafter's curve says (nothing is drafted)
    assert predict(Tree.chain(0), ACC, {1: 2.0}, 0.5, 0.5, baseline=1.0).speedup == 1.0


def test_cost_interpolation():
    curve = {1: 2.0, 4: 5.0, 16: 11.0}
    assert cost_at(curve, 2) == pytest.approx(3.0) and cost_at(curve, 10) == pytest.approx(8.0)
    assert cost_at(curve, 28) == pytest.approx(17.0)  # extrapolates the last segment


def test_expand_specs():
    specs = expand_specs([{"kind": "chain", "depth": [1, 2]}, {"kind": "full", "width": [2, 3], "depth": 2},
                          {"kind": "paths", "paths": [[0], [1]]}])
    assert [s.get("depth") for s in specs] == [1, 2, 2, 2, None] and specs[-1]["paths"] == [[0], [1]]


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
    assert all(len(r["runs"]["speedup"]) == 2 and len(r["runs"]["speedup_vs_transformers"]) == 2
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
    md = (tmp_path / "batch.md").read_text()
    assert "| B | drafter | best tree |" in md and "Where speculation stops paying" in md and "nan" not in md.lower()
    assert "## Batch sizes" in (tmp_path / "results.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "batch.csv")))
    assert {r["batch_size"] for r in rows} == {"1", "2"} and (tmp_path / "speedup_vs_batch.png").stat().st_size > 0
    (tmp_path / "batch.md").unlink()
    rerender(tmp_path)
    assert (tmp_path / "batch.md").read_text() == md


def test_bad_tree_spec_in_config_is_named(tmp_path):
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="compare", overrides=["trees=[{kind: full, width: 0, depth: 2}]", "logger=none"])
    with pytest.raises(ValueError, match=r"bad tree spec \{'kind': 'full', 'width': 0, 'depth': 2\}"):
        run_from_config(cfg, tmp_path)


def test_sampled_candidates_skip_dynamic_trees():
    from treespec.train.compare.configurations import resolve_tree

    target = tiny_llama(seed=0)
    sampled = DrafterSpec("eagle:sample", Eagle(EagleModel(target), candidates="sample"))
    tree, reason = resolve_tree({"kind": "dynamic", "total_tokens": 4, "depth": 2, "top_k": 2}, sampled, {1: 1.0}, 8)
    assert tree is None and "samples its candidates" in reason
    tree, reason = resolve_tree({"kind": "chain", "depth": 3}, sampled, {1: 1.0}, 8)
    assert len(tree) == 3 and reason is None


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


def test_accuracy_windows_are_the_targets_own_continuations():
    target = tiny_llama(seed=0)
    held_out = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    windows = own_continuations(target, held_out, context=12, new_tokens=6, lead=4, batch_size=2)
    assert windows.shape == (3, 4 + 6)
    assert torch.equal(windows[:, :4], held_out[:, 8:12])  # the prompt's last `lead` tokens, then the target's
    assert torch.equal(windows, hf_greedy(target, held_out[:, :12], 6)[:, 8:])
    sampled = [own_continuations(target, held_out, context=12, new_tokens=6, lead=4, temperature=1.0, seed=s)
               for s in (0, 0, 1)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])
    with pytest.raises(ValueError, match="shorter than context"):
        own_continuations(target, held_out, context=30)


def test_timing_runs_before_ahead_of_every_timed_call():
    # interleaved timing (a target pass timed right after a drafting call): before() runs, untimed, ahead of
    # every call, warm-up calls included, and the registry's drafting costs pass it through
    events = []
    median_time(lambda: events.append("timed"), repeats=3, warmup=1, before=lambda: events.append("before"))
    assert events == ["before", "timed"] * 4
    target = tiny_llama(seed=0)
    calls = []
    drafter = registry.make("eagle", EagleModel(target).eval())
    fixed, per_depth = registry.get("eagle").cost(drafter, before=lambda: calls.append(1))
    assert fixed == 0.0 and per_depth > 0 and len(calls) == 32  # median_time's 30 repeats + 2 warm-up
    # every drafter with weights can be timed between target passes (prompt lookup has none to push out)
    assert [kind.name for kind in registry.KINDS if not kind.has_weights] == ["prompt_lookup", "recycling", "suffix",
                                                                               "rest", "lookahead", "combined"]
    assert registry.get("prompt_lookup").drafting_step(PromptLookup()) is None
    for name in ("recycling", "suffix"):  # model-free too: nothing to time
        assert registry.get(name).drafting_step(registry.build(name, target)) is None
    step = registry.get("eagle").drafting_step(drafter)
    curve = measure_cost_curve(target, (1, 2), past_len=8, repeats=2, before=step)
    drafter.reset()
    assert set(curve) == {1, 2} and all(t > 0 for t in curve.values())


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


def test_sampled_chains_are_predicted_per_rule(tmp_path):
    """A drafter that samples its candidates, with its chain τ measured (treespec/planning/chain_tau.py): each rule's
    row is predicted from that rule's closed form (traversal on a chain is block verification), tree=auto picks a chain
    from it, and a branching tree is not predicted."""
    from treespec.planning.chain_tau import measure_chain_tau
    from treespec.sampling import Sampling

    target = tiny_llama(seed=0)
    drafter = DraftModel(perturbed(target, 0.05), candidates="sample")
    windows = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(1))
    chain = measure_chain_tau(target, drafter, windows, depth=3, sampling=Sampling(1.0), lead=8, cuts=2,
                              generator=torch.Generator().manual_seed(0))
    assert all(b >= r - 1e-6 for b, r in zip(chain.tau["block"], chain.tau["rejection"], strict=True))
    drafters = [DrafterSpec("draft", drafter, chain_tau=chain)]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))]
    result = run_comparison(target, drafters, [{"kind": "chain", "depth": 2}, {"kind": "full", "width": 2, "depth": 2},
                                               {"kind": "auto"}, {"kind": "accuracy", "nodes": 4}],
                            prompts, max_new_tokens=6, temperature=1.0, cost_sizes=(1, 2, 4), peers=False,
                            out_dir=tmp_path, log=lambda *_: None, acceptance=["rejection", "block", "traversal"])
    rows = {r["config"]: r for r in result["records"]}
    for rule, table in (("rejection", "rejection"), ("block", "block"), ("traversal", "block")):
        assert rows[f"draft | chain γ=2 | {rule}"]["predicted_tau"] == pytest.approx(chain.tau[table][2])
        auto = rows[f"draft | auto | {rule}"]  # a chain γ = 0..3 (γ = 0: no speculation)
        assert auto["depth"] <= 3 and auto["predicted_tau"] == pytest.approx(chain.tau[table][auto["depth"]])
    assert rows["draft | full 2×2 | traversal"]["predicted_tau"] is None
    assert any("accuracy trees grow top-k ranks" in s["reason"] for s in result["skipped"])
    assert result["chain_tau"]["draft"]["drafts"] == chain.drafts
    # generate()'s auto, with the profile the run kept, chooses under each rule the chain the run chose
    profile = load_profile(tmp_path / result["profiles"]["draft"])
    for rule in ("rejection", "block", "traversal"):
        out = generate(target, prompts[0], drafter=drafter, tree={"kind": "auto"}, profile=profile, max_new_tokens=6,
                       temperature=1.0, acceptance=rule, generator=torch.Generator().manual_seed(0))
        assert out.tree == build_tree(rows[f"draft | auto | {rule}"]["tree_spec"])


def test_generate_auto_chooses_the_comparisons_tree(tmp_path):
    """The run keeps each drafter's cost model and accuracies (profiles/<drafter>/): generate(tree=auto) with them
    picks the tree the run's auto picked, from the same numbers, and results.md says how."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    accuracy = draft_model_accuracy(target, draft, windows, depth=3, top_k=3)
    drafters = [DrafterSpec("draft", DraftModel(draft), accuracy, draft_cost_per_depth=1e-4, draft_cost_fixed=2e-4)]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))]
    result = run_comparison(target, drafters, [{"kind": "auto", "max_nodes": 8}], prompts, max_new_tokens=6,
                            cost_sizes=(1, 2, 4, 8), peers=False, out_dir=tmp_path, log=lambda *_: None)
    folder = tmp_path / result["profiles"]["draft"]
    profile = load_profile(folder)
    assert profile.accuracy == accuracy and profile.costs == CostModel.from_record(result["cost_models"]["draft"])
    assert profile.costs.draft_cost_fixed == 2e-4 and profile.costs.engine == EngineCost.from_record(result["engine"])
    out = generate(target, prompts[0], drafter=DraftModel(draft), tree={"kind": "auto", "max_nodes": 8},
                   profile=profile, max_new_tokens=6)
    auto = next(r for r in result["records"] if r["config"] == "draft | auto")
    assert out.tree == build_tree(auto["tree_spec"]) == choose_tree(accuracy, profile.costs, max_nodes=8)[0].tree
    md = (tmp_path / "results.md").read_text()
    assert f'load_profile("{folder.as_posix()}")' in md
    tree = out.tree  # the tables say what auto chose
    label = "none" if not len(tree) else f"chain γ={tree.depth}" if tree.is_chain else \
        f"{len(tree)} nodes, depth {tree.depth}"
    assert f"| draft | auto → {label} |" in md


def test_a_trees_own_size_is_put_on_the_curves_footing(monkeypatch):
    """The sizes a run's trees verify are timed beside the curve's own sizes around them and scaled by those
    anchors' ratio: timed in a spell twice as slow as the curve's, they still land on the curve's footing."""
    from treespec.train.compare import setup_costs
    from treespec.train.compare.configurations import DrafterSpec

    curve = {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0, 16: 5.0}
    slow = {1: 2.0, 2: 4.0, 3: 5.0, 4: 6.0, 5: 7.0, 8: 8.0, 16: 10.0}  # the machine twice as slow now
    timed = []
    monkeypatch.setattr(setup_costs, "measure_cost_curve",
                        lambda target, sizes, **kw: timed.append(sizes) or {n: slow[n] for n in sizes})
    d = DrafterSpec("prompt_lookup", drafter=None)
    planned = [(d, {"kind": "chain", "depth": 2}, "rejection"), (d, {"kind": "chain", "depth": 4}, "rejection")]
    setup_costs.measure_tree_sizes(None, [d], planned, [Tree.chain(2), Tree.chain(4)], curve, {}, 8,
                                   log=lambda *_: None)
    assert timed == [(1, 2, 3, 4, 5, 8)]  # the missing sizes and the curve's up to twice the largest
    assert curve[3] == pytest.approx(2.5) and curve[5] == pytest.approx(3.5) and list(curve) == sorted(curve)

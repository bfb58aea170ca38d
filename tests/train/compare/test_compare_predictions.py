"""The comparison's predictions (treespec/planning/autotree.py, train/compare/setup_costs.py): tree=auto picks the
predicted best tree, cost curves interpolated and a tree's own size put on the curve's footing, drafting timed
between target passes, accuracies measured on the target's own continuations, sampled chains predicted per
acceptance rule, and generate(tree=auto) choosing the comparison's tree from the profile it kept."""

import pytest
import torch

from treespec import generate
from treespec.heads import DraftModel, PromptLookup, load_profile, registry
from treespec.heads.draft_model.drafter import rank_accuracy as draft_model_accuracy
from treespec.heads.eagle import EagleModel
from treespec.planning.autotree import (
    CostModel,
    EngineCost,
    choose_tree,
    cost_at,
    measure_cost_curve,
    predict,
)
from treespec.planning.tree_spec import build_tree
from treespec.timing import median_time
from treespec.train.compare.configurations import DrafterSpec
from treespec.train.compare.harness import run_comparison
from treespec.train.training.data import own_continuations
from treespec.tree import Tree

from tests.helpers import hf_greedy, perturbed, tiny_llama

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


def test_sampled_chains_are_predicted_per_rule(tmp_path, no_report_figures):
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


def test_generate_auto_chooses_the_comparisons_tree(tmp_path, no_report_figures):
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

"""Every drafter predicted, and "auto" across drafters (issue 50, item 3): a model-free drafter's τ per tree and the
sizes its passes verified, from a dry run on held-out prompts (treespec/planning/model_free.py; timed on a virtual
clock, no real speed asserted); predictions charge what a pass verified; "auto" across a list chooses no speculation
when every drafter is predicted to lose and a drafter when one pays (treespec/planning/across.py); the chosen plan
decodes as vanilla greedy does, token for token; bad lists are refused naming the problem."""

import json

import pytest
import torch

from treespec import generate
from treespec.heads import DraftModel, PromptLookup, load_profile
from treespec.heads.draft_model.drafter import rank_accuracy as draft_model_accuracy
from treespec.planning import drafting_cost
from treespec.planning.across import Option, choose_across, plan_across
from treespec.planning.autotree import CostModel, EngineCost, choose_tree, cost_at, predict
from treespec.planning.measured_tau import MeasuredTrees, TreeRun, read_measured_trees, save_measured_trees
from treespec.planning.model_free import candidate_trees, measure_trees, model_free_profile
from treespec.planning.profile import DrafterProfile
from treespec.sampling import Sampling
from treespec.train.compare import setup_costs
from treespec.train.compare.configurations import DrafterSpec
from treespec.train.compare.harness import run_comparison
from treespec.train.compare.job_config import check_config
from treespec.tree import Tree

from tests.helpers import compose_cfg, hf_greedy, perturbed, tiny_llama

FLAT = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}  # every pass costs one unit, whatever it verifies
STEEP = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}  # every token verified costs one unit
PROMPTS = [torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8]]), torch.arange(3, 19)[None]]


def measured(*runs, rule="rejection") -> MeasuredTrees:
    return MeasuredTrees([TreeRun(tree, tau, sizes, 0.0, 10) for tree, tau, sizes in runs], Sampling(0.0), rule)


def test_a_model_free_drafter_gets_a_prediction(monkeypatch):
    """Prompt lookup's dry run gives τ per candidate tree, equal to what decoding the same prompts commits on the steps
    that drafted the whole tree, and the sizes its passes verified; a prediction charges those sizes."""
    monkeypatch.setattr(drafting_cost, "forward_time", lambda *a, **k: 0.01)  # no real timing: the pass is 10 ms
    target = tiny_llama(seed=0)
    drafter = PromptLookup()
    trees = candidate_trees(drafter)
    assert trees == [Tree.chain(g) for g in (1, 2, 3, 4, 6, 8)]  # its default, chain 4, among them: a chain drafter
    m, cost = measure_trees(target, drafter, PROMPTS, max_new_tokens=16)
    assert [r.tree for r in m.runs] == trees and cost.target_pass == pytest.approx(0.01)
    for run in m.runs:  # the same numbers decoding gives, counted here independently
        lengths = []
        for prompt in PROMPTS:
            accepted = generate(target, prompt, drafter=PromptLookup(), tree=run.tree, max_new_tokens=16).accept_lengths
            lengths += [accepted[i] for i in drafting_cost.whole_tree_steps(accepted, run.tree.depth, 16)]
        assert run.tau == pytest.approx(sum(lengths) / len(lengths)) and run.passes == len(lengths)
        assert sum(run.sizes.values()) == pytest.approx(1.0) and set(run.sizes) <= set(range(1, run.tree.num_nodes + 1))
    assert any(r.tau > 1 for r in m.runs) and any(len(r.sizes) > 1 for r in m.runs)  # it matched, and sometimes not
    # the prediction: τ as measured, each pass charged for what it verified (here the curve's cost per token)
    costs = CostModel(STEEP, engine=EngineCost(0.0, 0.5, 0.0))
    run = next(r for r in m.runs if len(r.sizes) > 1)
    p = predict(run.tree, m, costs)
    expected = sum(share * (cost_at(STEEP, n) + 0.5) for n, share in run.sizes.items())
    assert p.tau == run.tau and p.step_cost == pytest.approx(expected)
    assert p.speedup == pytest.approx(run.tau / expected)
    assert predict(Tree.chain(0), m, costs).speedup == 1.0
    with pytest.raises(ValueError, match="was not measured"):
        predict(Tree.chain(5), m, costs)


def test_measured_trees_are_kept_and_read_back(tmp_path):
    from treespec.dynamic_tree import DynamicTree

    m = measured((Tree.chain(2), 1.8, {1: 0.25, 3: 0.75}), (DynamicTree(16, 8, 4), 2.6, {5: 0.5, 9: 0.5}))
    save_measured_trees(tmp_path, [m])
    assert read_measured_trees(tmp_path) == [m]
    profile = load_profile(tmp_path)  # a comparison's profile folder of a model-free drafter
    assert profile.tau_source("auto", "topk", "rejection", Sampling(0.0)) == m
    assert profile.tau_source("auto", "topk", "block", Sampling(0.0)) == m  # at greedy: the same tokens per pass
    with pytest.raises(ValueError, match="holds none under rejection at T=1.0"):
        profile.tau_source("auto", "topk", "rejection", Sampling(1.0))
    (tmp_path / "measured_trees.json").write_text('{"measurements": [{"rule": "rejection"}]}')
    with pytest.raises(ValueError, match="measured_trees.json"):
        read_measured_trees(tmp_path)


def test_auto_across_picks_vanilla_when_every_drafter_is_predicted_to_lose():
    poor = Option("draft", [[0.05, 0.01], [0.02]], CostModel(STEEP, draft_cost_per_depth=0.3))
    lookup = Option("prompt_lookup", measured((Tree.chain(4), 1.3, {1: 0.5, 5: 0.5})), CostModel(STEEP))
    plan = choose_across([poor, lookup])
    assert plan.name is None and not len(plan.tree) and plan.prediction.speedup == 1.0
    assert set(plan.considered) == {("draft", "rejection"), ("prompt_lookup", "rejection")}
    # each was weighed at its own best tree, and none of those pays
    assert all(p.speedup <= 1.0 for p in plan.considered.values())
    assert plan.arguments == {"drafter": None, "tree": Tree.chain(0), "acceptance": "rejection"}


def test_auto_across_picks_a_drafter_when_one_pays():
    poor = Option("draft", [[0.05, 0.01], [0.02]], CostModel(FLAT, draft_cost_per_depth=0.3))
    lookup = Option("prompt_lookup", measured((Tree.chain(2), 1.9, {3: 1.0}), (Tree.chain(4), 2.6, {1: 0.2, 5: 0.8})),
                    CostModel(FLAT))
    plan = choose_across([poor, lookup])
    assert (plan.name, plan.tree, plan.acceptance) == ("prompt_lookup", Tree.chain(4), "rejection")
    assert plan.prediction.speedup == pytest.approx(2.6)
    # the better of two paying drafters wins, and the same drafter under block verification chooses among chains
    good = Option("draft", [[0.9, 0.05], [0.9], [0.9]], CostModel(FLAT, draft_cost_per_depth=0.01))
    best = choose_across([lookup, good])
    assert best.name == "draft" and best.prediction.speedup > 2.6
    assert best.prediction.speedup == pytest.approx(choose_tree([[0.9, 0.05], [0.9], [0.9]], good.costs)[0].speedup)
    wide = Option("prompt_lookup", measured((Tree.full(2, 2), 3.0, {7: 1.0}), (Tree.chain(2), 1.9, {3: 1.0}),
                                             rule="block"), CostModel(FLAT), "block")
    assert choose_across([wide]).tree == Tree.chain(2)


def test_the_chosen_plan_decodes_as_vanilla_greedy():
    """plan_across with a trained drafter (accuracies) and a model-free one (a dry run's τ per tree): whichever the
    profiles make it choose, and no speculation, generate() with the plan gives vanilla greedy's tokens."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    accuracy = draft_model_accuracy(target, draft, windows, depth=3, top_k=3)
    prompt = PROMPTS[0]
    expected = hf_greedy(target, prompt, 12)
    lookup_wins = measured((Tree.chain(4), 4.5, {5: 1.0}))
    cases = {"prompt_lookup": (CostModel(FLAT, draft_cost_per_depth=0.5), CostModel(FLAT)),
             "draft": (CostModel(FLAT), CostModel(STEEP)), None: (CostModel(STEEP, 2.0), CostModel(STEEP, 2.0))}
    for winner, (draft_costs, lookup_costs) in cases.items():
        drafters = {"draft": (DraftModel(draft), DrafterProfile(accuracy=accuracy, costs=draft_costs)),
                    "prompt_lookup": (PromptLookup(), DrafterProfile(costs=lookup_costs, measured=lookup_wins))}
        plan = plan_across(target, prompt, drafters, max_new_tokens=12)
        assert plan.name == winner and (plan.drafter is None) == (winner is None)
        out = generate(target, prompt, **plan.arguments, max_new_tokens=12)
        assert torch.equal(out.sequences, expected), winner
        assert out.tree == plan.tree


def test_bad_lists_are_refused_naming_the_problem(tmp_path):
    target = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="empty list"):
        choose_across([])
    with pytest.raises(ValueError, match="empty mapping"):
        plan_across(target, PROMPTS[0], {}, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"drafters\['lookup'\]: its profile needs this device's cost model"):
        plan_across(target, PROMPTS[0], {"lookup": (PromptLookup(), DrafterProfile())}, max_new_tokens=4)
    with pytest.raises(ValueError, match="twice"):
        choose_across([Option("a", [[0.5]], CostModel(FLAT))] * 2)
    # generate() decodes with one drafter: the across form is named, and where it belongs
    with pytest.raises(ValueError, match="plan_across"):
        generate(target, PROMPTS[0], drafter=PromptLookup(), tree={"kind": "auto", "drafters": ["x"]},
                 max_new_tokens=4)
    # the comparison's entry, checked before anything loads
    base = ["logger=none", "drafters=[prompt_lookup,suffix]"]
    for trees, message in ((["nope"], r"'nope' is not one of this run's drafters \(prompt_lookup, suffix\)"),
                           ([], "an empty list"), (["suffix", "suffix"], "named twice")):
        cfg = compose_cfg("compare", [*base, f"trees=[{{kind: auto, drafters: {trees}}}]".replace("'", "")])
        with pytest.raises(ValueError, match=message):
            check_config(cfg)
    cfg = compose_cfg("compare", [*base, "trees=[{kind: chain, drafters: [suffix]}]"])
    with pytest.raises(ValueError, match="only kind 'auto'"):
        check_config(cfg)
    check_config(compose_cfg("compare", [*base, "trees=[{kind: chain, depth: 2}, {kind: auto, drafters: [suffix]}]"]))
    with pytest.raises(ValueError, match="'eagle' is not one of this run's drafters"):  # the harness, called directly
        run_comparison(target, [DrafterSpec("prompt_lookup", PromptLookup())],
                       [{"kind": "auto", "drafters": ["eagle"]}], PROMPTS, max_new_tokens=4, peers=False,
                       out_dir=tmp_path / "refused", log=lambda *_: None)
    assert not (tmp_path / "refused").exists()


def test_the_comparison_predicts_model_free_drafters_and_reports_auto_across(tmp_path, monkeypatch):
    """A comparison with a model-free drafter measured by a dry run: its configurations are predicted from it, its
    "auto" chooses among its trees, "auto" across drafters is one configuration measured as what it chose, the report
    says what it chose per category with predicted and measured speedups, and the profile the run kept gives
    generate()'s auto the run's tree. The setup's timings are fixed, so the choice is known."""
    monkeypatch.setattr(setup_costs, "measure_cost_curve", lambda target, sizes, **kw: {n: 1e-3 for n in sizes})
    monkeypatch.setattr(setup_costs, "measure_prefill_curve", lambda target, lengths: {n: 1e-3 for n in lengths})
    monkeypatch.setattr(setup_costs, "measure_engine_cost", lambda target, **kw: EngineCost())
    target = tiny_llama(seed=0)
    lookup = measured((Tree.chain(2), 1.5, {1: 0.5, 3: 0.5}), (Tree.chain(4), 2.5, {1: 0.2, 5: 0.8}))
    poor = [[0.02, 0.01], [0.01]]
    drafters = [DrafterSpec("draft", DraftModel(perturbed(target, 0.05)), poor, draft_cost_per_depth=1e-3),
                DrafterSpec("prompt_lookup", PromptLookup(), measured=[lookup])]
    result = run_comparison(target, drafters, [{"kind": "chain", "depth": 2}, {"kind": "auto", "max_nodes": 8},
                                               {"kind": "auto", "drafters": ["draft", "prompt_lookup"]}],
                            PROMPTS, max_new_tokens=8, cost_sizes=(1, 2, 4, 8), peers=False, out_dir=tmp_path,
                            log=lambda *_: None)
    rows = {r["config"]: r for r in result["records"]}
    assert rows["prompt_lookup | chain γ=2"]["predicted_tau"] == 1.5
    assert rows["prompt_lookup | auto"]["tree_spec"] == Tree.chain(4).to_spec()
    across = rows["auto across draft, prompt_lookup"]
    assert across["chose"]["drafter"] == "prompt_lookup" and across["same_tree_as"] == "prompt_lookup | auto"
    assert across["runs"] == rows["prompt_lookup | auto"]["runs"]  # measured once, reported under both names
    assert across["predicted_speedup"] == rows["prompt_lookup | auto"]["predicted_speedup"]
    md = (tmp_path / "results.md").read_text()
    assert "## Auto across drafters" in md and "chose **prompt_lookup, chain γ=4** under rejection" in md
    assert "| all | auto → prompt_lookup, chain γ=4 |" in md
    profile = load_profile(tmp_path / result["profiles"]["prompt_lookup"])
    out = generate(target, PROMPTS[0], drafter=PromptLookup(), tree={"kind": "auto", "max_nodes": 8}, profile=profile,
                   max_new_tokens=8)
    assert out.tree == Tree.chain(4)


def test_a_dry_run_decodes_the_held_out_prompts_as_timed_prompts_are():
    """From the held-out prompt on, not from the target's continuation of it (which would hand a model-free drafter
    the target's own loops before it starts: τ far above the timed prompts'); a held-out text without prompts gives
    its windows."""
    from treespec.train.compare.dry_runs import prompts_of
    from treespec.train.compare.templates import HeldOutText

    windows = [torch.arange(10)[None], torch.arange(20, 32)[None]]
    held = HeldOutText(windows, [4, 5], [w[:, :lead] for w, lead in zip(windows, [4, 5], strict=True)])
    assert [p.tolist() for p in prompts_of(held)] == [[[0, 1, 2, 3]], [[20, 21, 22, 23, 24]]]
    assert [p.tolist() for p in prompts_of(HeldOutText(torch.arange(12).reshape(2, 6), 2), count=1)] == [
        [[0, 1, 2, 3, 4, 5]]]


def test_a_drafter_that_learns_meets_each_prompt_once_per_tree(monkeypatch):
    """SuffixDecoding learns from every answer: in a dry run each tree's copy meets the prompts one after another, as a
    comparison's configuration does, so its τ is a fresh drafter's on the first prompt, never one that has already
    seen this prompt's answer under another tree."""
    from treespec.heads import SuffixDecoding

    monkeypatch.setattr(drafting_cost, "forward_time", lambda *a, **k: 0.01)
    target = tiny_llama(seed=0)
    trees = [Tree.chain(2), Tree.chain(4)]
    m, _ = measure_trees(target, SuffixDecoding(), PROMPTS[:1], trees=trees, max_new_tokens=16)
    for run in m.runs:
        fresh = SuffixDecoding()
        accepted = generate(target, PROMPTS[0], drafter=fresh, tree=run.tree, max_new_tokens=16).accept_lengths
        whole = [accepted[i] for i in drafting_cost.whole_tree_steps(accepted, run.tree.depth, 16)]
        assert run.tau == pytest.approx(sum(whole) / len(whole))


@pytest.mark.parametrize("run, message", [
    # a measured_trees.json with these was read as is: a NaN τ made "auto" choose vanilla unsaid, shares of 5 a step
    # 5x its cost, no shares a ZeroDivisionError
    # (no bound from the tree: Combined verifies more nodes than the tree it is given)
    ((Tree.chain(2), float("nan"), {3: 1.0}), r"tau \(tokens per pass\) must be a number >= 1, got nan"),
    ((Tree.chain(2), 0.2, {3: 1.0}), r"got 0.2"),
    ((Tree.chain(2), 2.0, {3: 5.0}), r"sizes must map nodes verified \(root included, >= 1\) to shares of passes "
                                     r"summing to 1"),
    ((Tree.chain(2), 2.0, {0: 1.0}), r"sizes must map nodes verified"),
    ((Tree.chain(2), 2.0, {}), r"sizes must map nodes verified"),
    ((Tree.chain(2), 2.0, {1: -0.5, 3: 1.5}), r"sizes must map nodes verified"),
])
def test_an_impossible_measurement_is_refused_in_memory_and_in_its_file(tmp_path, run, message):
    with pytest.raises(ValueError, match=message):
        measured(run)
    record = measured((Tree.chain(2), 1.5, {1: 0.5, 3: 0.5})).record()
    record["trees"][0].update(tau=run[1], sizes={str(n): s for n, s in run[2].items()})
    (tmp_path / "measured_trees.json").write_text(json.dumps({"measurements": [record]}))
    with pytest.raises(ValueError, match=r"measured trees file .*measured_trees.json: .*" + message):
        read_measured_trees(tmp_path)
    for edit, named in (({"rule": "bogus"}, "rule must be one of"), ({"passes": 0}, "passes must be an integer >= 1"),
                        ({"drafting": float("inf")}, "drafting must be a fraction of a pass >= 0")):
        bad = measured((Tree.chain(2), 1.5, {1: 0.5, 3: 0.5})).record()
        (bad if "rule" in edit else bad["trees"][0]).update(edit)
        (tmp_path / "measured_trees.json").write_text(json.dumps({"measurements": [bad]}))
        with pytest.raises(ValueError, match=named):
            read_measured_trees(tmp_path)
    with pytest.raises(ValueError, match="holds a tree twice"):
        measured((Tree.chain(2), 2.0, {3: 1.0}), (Tree.chain(2), 1.0, {3: 1.0}))


def test_bad_options_and_dry_run_inputs_are_named_at_the_door():
    target, lookup = tiny_llama(seed=0), PromptLookup()
    option = Option("x", [[0.9], [0.9]], CostModel(FLAT))
    for kwargs, message in (({"max_nodes": -1}, r"max_nodes must be an integer >= 0 .* got -1"),  # max() of nothing
                            ({"max_nodes": "8"}, r"max_nodes must be an integer >= 0")):
        with pytest.raises(ValueError, match=message):
            choose_across([option], **kwargs)
    for bad in ("x", Option("x", [[0.9]], None), Option("x", [[0.9]], CostModel(FLAT), "bogus")):
        with pytest.raises(ValueError, match="weighs Options"):
            choose_across([bad])
    with pytest.raises(ValueError, match=r"rank accuracies are acc\[depth\]\[rank\] numbers"):  # "too many dimensions"
        choose_across([Option("x", "abc", CostModel(FLAT))])
    profile = DrafterProfile(costs=CostModel(FLAT), measured=[measured((Tree.chain(4), 4.5, {5: 1.0}))])
    with pytest.raises(ValueError, match=r"drafters\['l'\] must pair a treespec Drafter .* got NoneType"):
        plan_across(target, PROMPTS[0], {"l": (None, profile)}, max_new_tokens=8)  # a plan naming 'l', no drafter
    with pytest.raises(ValueError, match=r"plan_across chooses the tree"):  # was dropped unsaid
        plan_across(target, PROMPTS[0], {"l": (lookup, profile)}, max_new_tokens=8, tree=Tree.chain(2))
    # each of these failed inside torch or Python (expand, .to, trees[0], rules[0]) or kept a one-size curve
    for prompts, trees, message in (([torch.cat(PROMPTS)], None, r"prompt 0 is \(2, 16\)"),
                                    ([[1, 2, 3]], None, r"prompts are token ids \[1, P\] .* prompt 0 is list"),
                                    (PROMPTS, [], r"at least one tree to decode with")):
        with pytest.raises(ValueError, match=message):
            measure_trees(target, lookup, prompts, trees=trees, max_new_tokens=8)
    for kwargs, message in (({"acceptance": []}, r"acceptance: an empty list"),
                            ({"sizes": [1]}, r"sizes must be two or more different tree sizes")):
        with pytest.raises(ValueError, match=message):
            model_free_profile(target, lookup, PROMPTS, max_new_tokens=8, log=lambda *_: None, **kwargs)

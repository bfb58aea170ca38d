"""Planning at several batch sizes: the accept-length distribution and the whole-generation prediction of a batch
(treespec/planning/batch_generation.py), and "auto" per batch size (treespec/planning/batch_table.py): chosen from
each size's costs, measured once on the target and kept on the profile, resolved by generate()."""

import pytest
import torch

from treespec import Tree, generate
from treespec.batch_trees import TreesByBatch
from treespec.heads import DraftModel
from treespec.heads.draft_model.drafter import rank_accuracy as draft_model_accuracy
from treespec.inputs import left_padded
from treespec.planning import batch_table
from treespec.planning.analysis import expected_tree_tokens_from_rank_accuracy
from treespec.planning.autotree import CostModel, predict
from treespec.planning.batch_generation import BatchCosts, accept_distribution, predict_batch_generation
from treespec.planning.measured_tau import MeasuredTrees, TreeRun
from treespec.planning.profile import DrafterProfile
from treespec.planning.tree_spec import build_tree, check_tree_spec

from tests.helpers import hf_batch_greedy, perturbed, tiny_llama

ACC = [[0.8, 0.1], [0.7, 0.1], [0.6, 0.1], [0.5, 0.1]]


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2), Tree.from_paths([(0,), (1,), (0, 0), (0, 0, 0)])])
def test_accept_distribution_is_the_tau_estimate(tree):
    dist = accept_distribution(tree, ACC)
    assert len(dist) == tree.depth + 1 and abs(sum(dist) - 1) < 1e-12 and min(dist) >= 0
    assert sum(k * p for k, p in enumerate(dist)) + 1 == pytest.approx(expected_tree_tokens_from_rank_accuracy(tree,
                                                                                                                ACC))


def test_a_tau_only_source_gets_the_chain_with_that_tau():
    tree = Tree.chain(4)
    source = MeasuredTrees([TreeRun(tree, 2.5, {5: 1.0}, 0.01, 10)])
    dist = accept_distribution(tree, source)
    assert sum(k * p for k, p in enumerate(dist)) + 1 == pytest.approx(2.5, abs=1e-6)
    assert dist == sorted(dist, reverse=True) or dist[-1] > 0  # a geometric rate: P(k) falls, the last holds the rest


# flat at B = 1 (a tree pass costs little more than a token), steep at B = 8 (every token paid in full)
COSTS = BatchCosts({1: CostModel({1: 0.010, 4: 0.011, 8: 0.012}),
                    8: CostModel({1: 0.020, 2: 0.040, 4: 0.080, 8: 0.160})})


def test_one_row_is_the_per_step_prediction():
    tree = Tree.chain(3)
    whole = predict_batch_generation(tree, ACC, COSTS, [2000], simulations=50)
    assert whole.speedup == pytest.approx(predict(tree, ACC, COSTS.by_size[1]).speedup, rel=0.02)
    assert whole.tau == pytest.approx(expected_tree_tokens_from_rank_accuracy(tree, ACC), rel=0.02)
    assert predict_batch_generation(Tree.chain(0), ACC, COSTS, [64] * 4).speedup == pytest.approx(1.0)


def test_the_slowest_row_sets_a_batch_time():
    """Same costs at every B: a batch gains less than one row, since it runs until its slowest row ends."""
    same = BatchCosts({1: COSTS.by_size[1], 8: COSTS.by_size[1]})
    tree = Tree.chain(3)
    one = predict_batch_generation(tree, ACC, same, [48]).speedup
    eight = predict_batch_generation(tree, ACC, same, [48] * 8)
    assert eight.passes > predict_batch_generation(tree, ACC, same, [48]).passes
    # the last passes run fewer rows at the same cost here, so the batch's time is its slowest row's
    assert eight.speedup < one


def test_a_table_switches_as_rows_end():
    """With vanilla at 8 rows and a chain below 4, the batch speculates only once few rows are left: a speedup between
    vanilla's and the chain's at 1 row, and never below 1 on costs where vanilla is the right choice at 8."""
    table = TreesByBatch({4: Tree.chain(3), 8: Tree.chain(0)})
    mixed = predict_batch_generation(table.at, ACC, COSTS, [8, 16, 24, 32, 40, 48, 56, 64]).speedup
    vanilla = predict_batch_generation(Tree.chain(0), ACC, COSTS, [8, 16, 24, 32, 40, 48, 56, 64]).speedup
    assert vanilla == pytest.approx(1.0) and mixed > 1.0


def test_choose_table_speculates_where_it_pays():
    table = batch_table.choose_table(ACC, COSTS.by_size, max_nodes=8)
    assert len(table.at(1)) > 0 and len(table.at(8)) == 0 and table.pauses


@pytest.mark.parametrize("sizes, match", [([], "distinct integers"), ([0, 2], "distinct integers"),
                                          ([2, 2], "distinct integers"), ("4", "a list of batch sizes")])
def test_bad_batch_sizes_are_named(sizes, match):
    with pytest.raises(ValueError, match=match):
        check_tree_spec({"kind": "auto", "batch_sizes": sizes})


def test_build_tree_refuses_a_table_it_cannot_measure():
    with pytest.raises(ValueError, match="measured on the target"):
        build_tree({"kind": "auto", "batch_sizes": [1, 4]}, accuracy=ACC, choose=lambda *_: Tree.chain(1))


@pytest.fixture(scope="module")
def drafted():
    """A tiny target, a draft model that agrees often, its profile and three prompts (the reference: transformers'
    batched greedy generate)."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)
    windows = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    accuracy = draft_model_accuracy(target, draft, windows, depth=3, top_k=2)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    ids, mask = left_padded(prompts, 0)
    return target, draft, accuracy, prompts, hf_batch_greedy(target, ids, mask, 12)


def test_generate_measures_each_size_once(drafted, monkeypatch):
    target, draft, accuracy, prompts, expected = drafted
    profile = DrafterProfile(accuracy=accuracy)
    spec = {"kind": "auto", "batch_sizes": [1, 3], "max_nodes": 6}
    out = generate(target, prompts, drafter=DraftModel(draft), profile=profile, tree=spec, max_new_tokens=12)
    assert set(profile.batch_costs) == {1, 3} and torch.equal(out.sequences, expected)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(batch_table, "measure_batch_costs", no_timing)
    again = generate(target, prompts, drafter=DraftModel(draft), profile=profile, tree=spec, max_new_tokens=12)
    assert again.tree == out.tree and torch.equal(again.sequences, out.sequences)
    with pytest.raises(ValueError, match="needs the drafter's measured profile"):
        generate(target, prompts, drafter=DraftModel(draft), tree=spec, max_new_tokens=4)


def test_generate_follows_the_table_it_chose(drafted):
    """Costs where a tree pays at 1 row and not at 3 (kept on the profile as if measured): the batch decodes without
    a tree, then drafts for the last row, and every row is transformers' greedy."""
    target, draft, accuracy, prompts, expected = drafted
    profile = DrafterProfile(accuracy=accuracy, batch_costs={1: COSTS.by_size[1], 3: COSTS.by_size[8]})
    out = generate(target, prompts, drafter=DraftModel(draft), profile=profile, max_new_tokens=12,
                   tree={"kind": "auto", "batch_sizes": [1, 3], "max_nodes": 6})
    assert isinstance(out.tree, TreesByBatch) and len(out.tree.at(1)) > 0 and len(out.tree.at(3)) == 0
    assert torch.equal(out.sequences, expected)

"""A drafter's cost measured in the decoding loop (treespec/planning/drafting_cost.py): the fit's arithmetic, the
measurement on a virtual clock (a drafter that spends known seconds per step, depth and node; no real speed is
asserted), the calibration trees cut to a drafter's depth, and the cost model that carries the per-node term."""

import pytest
import torch

from treespec.planning import drafting_cost
from treespec.planning.autotree import CostModel, cost_curve_record
from treespec.planning.drafting_cost import (
    DraftingCost,
    calibration_trees,
    fit_drafting,
    measure_drafting_cost,
    own_text_prompts,
)
from treespec.planning.engine_cost import PlaceholderDrafter
from treespec.tree import Tree

from tests.helpers import tiny_llama


def test_fit_recovers_each_term_and_keeps_them_non_negative():
    points = [(d, n, 2e-3 + 3e-3 * d + 5e-4 * n) for d, n in ((2, 3), (6, 7), (3, 15), (2, 21))]
    assert fit_drafting(points) == pytest.approx((2e-3, 3e-3, 5e-4))
    # a drafter that fills its tree at once: nothing per depth, the fit does not make up a negative one
    medusa = [(d, n, 1e-3 + 1e-4 * n) for d, n in ((2, 3), (4, 5), (3, 15), (2, 21))]
    assert fit_drafting(medusa) == pytest.approx((1e-3, 0.0, 1e-4))
    falling = [(2, 3, 4e-3), (6, 7, 1e-3)]  # deeper and cheaper: noise, never a negative cost
    assert all(term >= 0 for term in fit_drafting(falling))
    assert fit_drafting([(2, 3, 0.0), (6, 7, 0.0)]) == (0.0, 0.0, 0.0)  # no drafting at all (prompt lookup)
    with pytest.raises(ValueError, match="at least one"):
        fit_drafting([])


def test_calibration_trees_fit_a_drafters_depth():
    assert calibration_trees(None) == list(drafting_cost.DRAFTING_TREES)
    cut = calibration_trees(4)
    assert Tree.chain(4) in cut and Tree.full(2, 3) in cut and all(t.depth <= 4 for t in cut)
    one = calibration_trees(1)  # chains 2 and 6 both become chain 1: measured once
    assert one == [Tree.chain(1), Tree.full(2, 1), Tree.full(4, 1)]


class VirtualClock:
    now = 0.0


class TimedPlaceholder(PlaceholderDrafter):
    """Proposes the tree it is given, spending (on the virtual clock) 2 ms per step, 3 ms per depth and 0.5 ms per
    node: what the measurement must find."""

    def propose(self, committed, feature, tree, sampling, generator=None):
        VirtualClock.now += 2e-3 + 3e-3 * tree.depth + 5e-4 * tree.num_nodes
        return super().propose(committed, feature, tree, sampling, generator)


def test_measured_in_the_loop_as_fractions_of_a_pass(monkeypatch):
    monkeypatch.setattr(drafting_cost.CallTimer, "clock", lambda self: VirtualClock.now)
    monkeypatch.setattr(drafting_cost, "forward_time", lambda *a, **k: 0.01)  # the pass alone: 10 ms
    target = tiny_llama(seed=0)
    prompts = [torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    drafter = TimedPlaceholder(Tree.chain(1))
    cost = measure_drafting_cost(target, drafter, prompts, max_new_tokens=12)
    assert cost.target_pass == pytest.approx(0.01)
    assert (cost.fixed, cost.per_depth, cost.per_node) == pytest.approx((0.2, 0.3, 0.05))
    assert cost.on(0.02) == pytest.approx((4e-3, 6e-3, 1e-3))  # put on another curve's pass
    batched = measure_drafting_cost(target, drafter, prompts[:1], max_new_tokens=12, batch=2)
    assert (batched.fixed, batched.per_depth) == pytest.approx((0.2, 0.3))  # one proposal per pass, both rows
    with pytest.raises(ValueError, match="at least one prompt"):
        measure_drafting_cost(target, drafter, [])


def test_own_text_prompts_are_the_targets_greedy_text():
    target = tiny_llama(seed=0)
    prompts = own_text_prompts(target, count=2, seed_tokens=4, length=6)
    assert [p.shape for p in prompts] == [torch.Size([1, 10])] * 2 and not torch.equal(prompts[0], prompts[1])
    from treespec import generate

    again = generate(target, prompts[0][:, :4], max_new_tokens=6).sequences
    assert torch.equal(again, prompts[0])


def test_the_cost_model_charges_drafting_per_node_and_keeps_it_in_its_record():
    costs = CostModel({1: 1e-3, 16: 2e-3}, 1e-4, 2e-4, draft_cost_per_node=1e-5)
    tree = Tree.full(2, 3)  # 15 nodes, depth 3
    assert costs.step(tree) - CostModel({1: 1e-3, 16: 2e-3}, 1e-4, 2e-4).step(tree) == pytest.approx(15 * 1e-5)
    again = CostModel.from_record(costs.record())
    assert again == costs
    old = cost_curve_record({1: 1e-3}, draft_cost_per_depth=2e-4)
    del old["draft_cost_per_node"]  # written before the term existed: none
    assert CostModel.from_record(old).draft_cost_per_node == 0.0
    assert DraftingCost(0.1, 0.2, 0.01).per_node == 0.0


def test_only_steps_that_drafted_the_whole_tree_count():
    # budget 12, chain 6: generate() cuts the tree from the step that starts with 6 tokens committed
    assert drafting_cost.whole_tree_steps([2, 1, 1, 1, 1, 1, 1, 1, 1, 1], 6, 12) == [0, 1, 2, 3]
    assert drafting_cost.whole_tree_steps([7, 4], 6, 12) == [0]
    assert drafting_cost.whole_tree_steps([], 2, 12) == []

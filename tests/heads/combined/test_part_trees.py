"""A part of a combination on its own tree (``Combined(..., part_trees=[...])``, heads/combined/drafter.py): each part
is asked for its own tree, cut where the step's is; the output is vanilla greedy's in union and fallback mode, one
prompt at a time and in a ragged batch; bad trees and specs are refused by name. Sampled losslessness with a DDTree
part, and its negative control, are in test_combined.py's SAMPLED cases."""

from __future__ import annotations

import pytest
import torch

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, DFlash, PromptLookup, TokenRecycling, registry

from tests.helpers import dflash_target, random_dflash


@pytest.mark.parametrize("mode", ["union", "fallback"])
def test_a_part_drafts_on_its_own_tree(mode, monkeypatch):
    """``part_trees``: prompt lookup on the step's chain of 4, a DFlash block on its own trees (DDTree's best 5
    nodes, a static 2 × 2 tree): each is asked for its own tree every step, and the output is vanilla greedy's,
    one prompt at a time and in a ragged batch."""
    target = dflash_target()
    ids = torch.tensor([[5, 9, 13, 2, 7, 11] * 3 + [4, 8]])
    for own in (DynamicTree(5, 3, 2), Tree.full(2, 2)):  # the random block fills depths 1-3
        lookup, block = PromptLookup(max_ngram=2), DFlash(random_dflash(target, seed=1))
        asked: dict[str, list] = {"lookup": [], "block": []}
        for name, part in (("lookup", lookup), ("block", block)):  # the block's: with the step's tree (lookup's)
            monkeypatch.setattr(part, "propose", lambda c, f, tree, *a, _n=name, _p=part.propose, _seen=asked: (
                _seen[_n].append(tree if _n == "lookup" else (tree, _seen["lookup"][-1])), _p(c, f, tree, *a))[1])
        drafter = Combined([lookup, block], mode=mode, min_nodes=3, part_trees=[None, own])
        out = generate(target, ids, drafter=drafter, tree=Tree.chain(4), max_new_tokens=24)
        assert torch.equal(out.sequences, generate(target, ids, max_new_tokens=24).sequences), (mode, own)
        # its own tree, cut where the step's is (near the end): never deeper than the step's
        assert asked["block"] and asked["block"][0][0] == own
        assert set(asked["lookup"]) <= {Tree.chain(d) for d in range(1, 5)}
        assert all(b == own.truncate(min(own.depth, step.depth)) for b, step in asked["block"])
        rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2])]
        out = generate(target, rows, drafter=drafter, tree=Tree.chain(4), max_new_tokens=12)  # left-padded
        for b, row in enumerate(rows):
            assert torch.equal(out.sequences[b, -12:], generate(target, row[None], max_new_tokens=12).sequences[
                0, len(row):]), (mode, own)


def test_part_trees_are_checked():
    target = dflash_target()
    with pytest.raises(ValueError, match="one entry per drafter"):
        Combined([PromptLookup(), TokenRecycling()], part_trees=[None])
    with pytest.raises(ValueError, match="must be a Tree, a DynamicTree or None"):
        Combined([PromptLookup(), TokenRecycling()], part_trees=[None, {"kind": "chain", "depth": 2}])
    with pytest.raises(ValueError, match="TokenRecycling grows no dynamic tree"):
        Combined([PromptLookup(), TokenRecycling()], part_trees=[None, DynamicTree(4, 2, 2)])
    with pytest.raises(ValueError, match="DFlash fills trees of depth <= 3, got depth 4"):  # a block of 4
        Combined([PromptLookup(), DFlash(random_dflash(target))], part_trees=[None, Tree.chain(4)])
    # a part on its own tree sets no limit on the step's (prompt lookup's chain of 9 beside a block of 4)
    assert Combined([PromptLookup(), DFlash(random_dflash(target))], part_trees=[None, Tree.chain(3)]
                    ).max_tree_depth is None
    kind = registry.get("combined")
    with pytest.raises(ValueError, match="grown from a drafter's accuracies"):
        kind.check_settings("fallback", part_trees=[None, {"kind": "accuracy", "nodes": 7}])
    with pytest.raises(ValueError, match="unknown key"):
        kind.check_settings("fallback", part_trees=[None, {"kind": "chain", "depth": 2, "width": 2}])
    with pytest.raises(ValueError, match="one tree spec or null per part"):
        kind.check_settings("fallback", part_trees={"kind": "chain", "depth": 2})
    made = kind.combine([PromptLookup(), DFlash(random_dflash(target))], mode="fallback",
                        part_trees=[None, {"kind": "dynamic", "total_tokens": 7, "depth": 3, "top_k": 4}])
    assert made.part_trees == [None, DynamicTree(7, 3, 4)]

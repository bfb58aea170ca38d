"""The union of several proposals' trees by shared prefixes, within a node budget: the tree a Combined verifies.

Two nodes whose paths from the root spell the same tokens are one node; the first proposal's nodes come first,
then each next one's new nodes, each in its own order (parents before children), until ``budget`` candidates.
Siblings stay distinct tokens (the first proposal's in their order, then the others'), so the walker's sibling rule
verifies the union losslessly when every candidate is a function of the past (treespec/walker.py).
"""

from __future__ import annotations

import torch

from treespec.drafter import Proposal
from treespec.tree import Tree


def merge(proposals: list[Proposal], budget: int, tokens: list[list[int]] | None = None
          ) -> tuple[Proposal, list[dict[int, int]]]:
    """The union of ``proposals`` by shared prefixes, at most ``budget`` candidates → (the merged proposal, per
    proposal: its node index → the merged tree's node index, for the nodes kept). ``tokens``: each proposal's
    candidates already on the host (one read of a batch's, not one per row); None: read from the proposals."""
    rank_paths: list[tuple[int, ...]] = [()]  # merged id → its path of sibling ranks
    merged: list[int] = [-1]  # merged id → its token
    kids: list[dict[int, int]] = [{}]  # merged id → {token: merged id}, in insertion (rank) order
    to_merged = []
    for k, proposal in enumerate(proposals):
        parents = proposal.tree.parent_list
        drafted = tokens[k] if tokens is not None else proposal.tokens.tolist()
        mapped = {0: 0}
        for i in range(1, proposal.tree.num_nodes):  # parents before children
            parent = mapped.get(parents[i])
            if parent is None:
                continue
            token = drafted[i - 1]
            if token in kids[parent]:
                mapped[i] = kids[parent][token]
            elif len(merged) - 1 < budget:
                mapped[i] = kids[parent][token] = len(merged)
                rank_paths.append((*rank_paths[parent], len(kids[parent]) - 1))
                merged.append(token)
                kids.append({})
        to_merged.append(mapped)
    tree = Tree(rank_paths[1:])
    node_of = {(): 0} | {path: i + 1 for i, path in enumerate(tree.paths)}  # Tree: by depth, then path
    order = [node_of[p] for p in rank_paths]  # merged id → tree node (the root: 0)
    ordered = [0] * len(tree)
    for merged_id in range(1, len(merged)):
        ordered[order[merged_id] - 1] = merged[merged_id]
    maps = [{i: order[m] for i, m in mapped.items()} for mapped in to_merged]
    return Proposal(tree, torch.tensor(ordered, dtype=torch.long)), maps

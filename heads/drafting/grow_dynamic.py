"""EAGLE-2's dynamic tree grown on the device (Li et al. 2024b; the rule itself: treespec/dynamic_tree.py), for the
drafters that expand depth by depth over their own cache (heads/drafting/expansion.py).

Each row grows its own tree with the same budget, in fixed shapes, as SGLang grows it: the root's k = ``top_k``
children, then at every further depth the k newest nodes with the best cumulative draft log-probability (in float64,
as ``DynamicTree.child_score`` adds them on the host) each propose their k likeliest children. A row holds
1 + k + (depth − 1)·k² grown nodes, numbered depth by depth and within a depth by frontier rank, then child rank.
Scores, frontiers and the masks' ancestry (each frontier node's ancestor at every earlier depth, compared with what
that depth expanded) stay on the device; no depth reads anything back. The kept tree (the best ``total_tokens``
nodes by score, ties to the smaller id, as ``DynamicTree.select`` keeps them) is read back once, with what each
depth expanded: the target's tree mask and the drafter's cache bookkeeping are built from it on the host. A
recurrent draft (one prompt: treespec/recurrent.py's rows) gathers its rows by each depth's frontier, which it
reads back at every depth.
"""

from __future__ import annotations

import torch

from treespec.drafter import Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.visibility import attention_masks, slots_mask


def grow_dynamic(drafter, logits: torch.Tensor, policy: DynamicTree) -> Proposals:
    """``drafter`` (an ExpandingDrafter) grows every row's tree from the draft logits at its root [b, 1, V] →
    each row's Tree and top-k candidates (deterministic); sets the drafter's ``_expanded`` and ``_grown_of``."""
    batch, device = logits.shape[0], logits.device
    k = min(policy.top_k, logits.shape[-1])
    total = 1 + k + (policy.depth - 1) * k * k  # grown nodes per row, the root included
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    parents = torch.zeros(batch, total, dtype=torch.long, device=device)
    scores = torch.zeros(batch, total, dtype=torch.float64, device=device)  # cumulative draft log-probability
    drafter._grown_count = total
    frontier = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [b, F]: the root
    expanded: list[torch.Tensor] = []  # each depth's frontier [b, k], in cache order
    for depth in range(1, policy.depth + 1):
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [b, F, k], descending
        first = 1 if depth == 1 else 1 + k + (depth - 2) * k * k  # this depth's first grown id
        ids = slice(first, first + frontier.shape[1] * k)
        parent = frontier.repeat_interleave(k, dim=1)  # [b, F·k]
        tokens[:, ids], parents[:, ids] = top.indices.flatten(1), parent
        before = scores.gather(1, parent)
        scores[:, ids] = torch.minimum(before + top.values.double().flatten(1), before)  # DynamicTree.child_score
        if depth == policy.depth:
            break
        # the k newest nodes with the best scores (a stable sort: ties to the smaller id)
        frontier = torch.sort(-scores[:, ids], dim=1, stable=True).indices[:, :k] + first  # [b, k]
        logits = _expand(drafter, frontier, expanded, tokens, parents)
        expanded.append(frontier)
    kept = torch.sort(-scores[:, 1:], dim=1, stable=True).indices[:, : policy.total_tokens] + 1  # [b, T]
    read = torch.cat([*expanded, kept, parents], dim=1).tolist()  # the tree's one host read
    ranks = [0, *range(k)] + [j % k for _ in range(policy.depth - 1) for j in range(k * k)]  # among siblings
    trees, drafter._grown_of, drafter._expanded = [], [], []
    for row in read:
        done, rest = row[: k * len(expanded)], row[k * len(expanded) :]
        tree, grown_of = DynamicTree.tree_of(rest[: kept.shape[1]], rest[kept.shape[1] :], ranks)
        trees.append(tree)
        drafter._grown_of.append(grown_of)
        drafter._expanded.append(done)
    width = max(len(tree) for tree in trees)
    index = torch.tensor([grown_of[1:] + [0] * (width - len(grown_of) + 1) for grown_of in drafter._grown_of])
    return Proposals(trees, tokens.gather(1, index.to(device)))


def _expand(drafter, frontier: torch.Tensor, expanded: list[torch.Tensor], tokens: torch.Tensor,
            parents: torch.Tensor) -> torch.Tensor:
    """The draft logits [b, k, V] at the ``frontier`` nodes [b, k] (depth d = len(expanded) + 1), which see the row's
    committed entries, their ancestors among the ``expanded`` ones (depth j's at entry j − 1) and themselves."""
    batch, k = frontier.shape
    frontier_tokens, frontier_parents = tokens.gather(1, frontier), parents.gather(1, frontier)
    if drafter._path_rows is not None:  # rows of a recurrent draft's cache, gathered by their parents' on the host
        nodes, ups = torch.cat([frontier, frontier_parents]).tolist()
        return drafter._expand_rows(nodes, ups, frontier_tokens)
    ancestors = [frontier]
    for _ in expanded:  # each frontier node's ancestor one depth up, then the next
        ancestors.insert(0, parents.gather(1, ancestors[0]))
    # [b, k, K]: a frontier node sees the expanded node at depth j that is its ancestor there, and itself
    blocks = [up[:, :, None] == done[:, None, :] for up, done in zip(ancestors, expanded, strict=False)]
    allowed = torch.cat([*blocks, torch.eye(k, dtype=torch.bool, device=frontier.device).expand(batch, k, k)], dim=2)
    depths = torch.arange(1, len(expanded) + 2).repeat_interleave(k)  # [K]: the expanded nodes' depths
    positions = drafter.slots.positions(depths - 1)  # [b or 1, K]: each row's root position + depth
    if not drafter.slots.ragged and batch == 1:  # one row: the mask of its windows
        mask = attention_masks(drafter.cache, allowed[0], drafter.slots.length, positions[0],
                               dtype=drafter.model.dtype, device=drafter.model.device)
    else:
        mask = slots_mask(drafter.slots, allowed, dtype=drafter.model.dtype)
    return drafter._forward_nodes(frontier_tokens, frontier, frontier_parents, mask, positions[:, -k:])

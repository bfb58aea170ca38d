"""Trees over a block: candidates drawn from per-position distributions that do not depend on the parent's token.

A block drafter (DFlash, heads/dflash/; PARD, heads/draft_model/parallel.py) gives, in one pass, a distribution q_d
for every depth d = 1..D of the block it fills: position d's distribution is the same whichever tokens sit at depths
< d, since the block is not autoregressive. Any tree over the block is therefore filled from those D distributions
alone:

* a static ``Tree``: a node at depth d with rank r is q_d's rank-r token (deterministic top-k candidates, verified
  with EAGLE-2's sibling rule), or its children are drawn from q_{d+1}, i.i.d. (``candidates="sample"``) or without
  replacement (``"without_replacement"``); ``q_draft`` of a node is then exactly q_{d+1}, the distribution its
  children were drawn from, so the walker's rules stay lossless (treespec/walker.py);
* a ``DynamicTree`` budget (DDTree, arXiv 2604.12989): the best tree of at most ``len(policy)`` nodes, a node's value
  being the product of its path's probabilities (its score: the sum of their logs); a node at depth d chooses among
  q_d's ``top_k`` likeliest tokens. Grown best-first with a heap (``best_paths``): the first child of a node and the
  next sibling of a node enter the heap when it is taken, and both score at most as much as it does, so the nodes
  taken are the best ones and form a Tree whose siblings stay in q's rank order (deterministic candidates).

Nothing is read back while a static tree is filled; a dynamic one reads the top-k log-probabilities once (their
values decide the shape, from which the target's tree mask is built on the host), as EAGLE-2's does.
"""

from __future__ import annotations

import heapq
import math

import torch

from treespec.drafter import SAMPLED_CANDIDATES, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling, probs, sample, sample_without_replacement, top_k
from treespec.tree import Tree


def best_paths(log_probs: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The rank paths of the ``budget`` nodes with the highest score (the sum of their path's log-probabilities),
    best first (ties to the smaller path). ``log_probs[d][r]``: the log-probability of position d + 1's rank-r token,
    each row non-increasing (as ``topk`` gives them). Nodes of score -inf (tokens the draft gives no mass) are never
    taken. Every kept node's parent and better-ranked siblings are kept: the paths make a ``Tree``."""
    depth = len(log_probs)
    if depth == 0 or budget < 1 or not log_probs[0]:
        return []
    heap = [(-log_probs[0][0], (0,), 0.0)]  # (−score, rank path, its parent's score)
    kept: list[tuple[int, ...]] = []
    while heap and len(kept) < budget:
        negative, path, parent = heapq.heappop(heap)
        score = -negative
        if score == -math.inf:
            break
        kept.append(path)
        d, rank = len(path), path[-1]
        if rank + 1 < len(log_probs[d - 1]):  # the next sibling: the parent's score plus its own term
            heapq.heappush(heap, (-min(parent + log_probs[d - 1][rank + 1], score), (*path[:-1], rank + 1), parent))
        if d < depth:  # the first child
            heapq.heappush(heap, (-min(score + log_probs[d][0], score), (*path, 0), score))
    return kept


def budget_of(policy: DynamicTree, depth: int, top_k: int) -> int:
    """The most nodes a block tree grown for ``policy`` over ``depth`` positions of ``top_k`` candidates keeps:
    ``total_tokens``, capped at what the loop sizes a dynamic tree's pass by (``len`` of the same budget)."""
    return len(DynamicTree(policy.total_tokens, depth, top_k))


def block_proposals(logits: torch.Tensor, tree: Tree | DynamicTree, sampling: Sampling, candidates: str = "topk",
                    generator: torch.Generator | None = None, *, what: str = "block") -> Proposals:
    """A block drafter's proposals from its block's logits [b, D, V] (depth d + 1's at d): DDTree's best tree for a
    ``DynamicTree`` (deterministic candidates only), else ``static_block_proposals``; a static tree deeper than the D
    positions ``what`` fills is refused, naming them."""
    if isinstance(tree, DynamicTree):
        if candidates in SAMPLED_CANDIDATES and not sampling.greedy:
            raise ValueError(f"{tree!r} grows deterministic top-k candidates; candidates={candidates!r} needs a static "
                             "Tree")
        return dynamic_block_proposals(logits, tree)
    if tree.depth > logits.shape[1]:
        raise ValueError(f"{tree!r} is deeper than the {logits.shape[1]} positions {what} fills")
    return static_block_proposals(logits, tree, sampling, candidates, generator)


def dynamic_block_proposals(logits: torch.Tensor, policy: DynamicTree) -> Proposals:
    """Each row's best tree (DDTree, module docstring) from its block's logits [b, D, V] (depth d + 1's at d) →
    Proposals of deterministic top-k candidates, each row with its own Tree; one host read."""
    depth = min(policy.depth, logits.shape[1])
    k = min(policy.top_k, logits.shape[-1])
    top = torch.log_softmax(logits[:, :depth].float(), dim=-1).topk(k, dim=-1)  # [b, D, k], descending
    budget = budget_of(policy, depth, k)
    trees = [Tree(best_paths(row, budget)) for row in top.values.tolist()]  # the one host read
    width = max(len(tree) for tree in trees)
    index = torch.tensor([[(len(p) - 1) * k + p[-1] for p in tree.paths] + [0] * (width - len(tree))
                          for tree in trees], dtype=torch.long)  # [b, n]: (depth − 1, rank) flattened
    tokens = top.indices.flatten(1).gather(1, index.to(logits.device))
    return Proposals(trees, tokens)


def static_block_proposals(logits: torch.Tensor, tree: Tree, sampling: Sampling, candidates: str = "topk",
                           generator: torch.Generator | None = None) -> Proposals:
    """``tree``'s candidates in every row from its block's logits [b, D, V] (depth d + 1's at d, D >= tree.depth):
    top-k ranks, or children drawn from the next depth's distribution (module docstring) at temperature > 0."""
    batch = logits.shape[0]
    if len(tree) == 0:
        return Proposals.shared(tree, logits.new_zeros(batch, 0, dtype=torch.long))
    draw = candidates in SAMPLED_CANDIDATES and not sampling.greedy
    if not draw:  # node i is q_{depth i}'s rank-(rank i) token
        top = top_k(logits[:, : tree.depth], max(tree.top_k_per_depth()))  # [b, D, K]
        depths, ranks = tree.depths[1:].to(top.device), tree.ranks[1:].to(top.device)
        return Proposals.shared(tree, top[:, depths - 1, ranks])
    distinct = candidates == "without_replacement"
    q = probs(logits[:, : tree.depth], sampling)  # [b, D, V]: q[:, d - 1] is depth d's
    tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.long, device=logits.device)  # [b, N]
    q_draft = q.new_zeros(batch, tree.num_nodes, q.shape[-1])  # [b, N, V]
    for node, kids in enumerate(tree.children):
        if not kids:
            continue
        child = q[:, tree.depth_list[node]]  # [b, V]: the distribution of the depth below the node
        q_draft[:, node] = child
        drawn = sample_without_replacement(child, len(kids), generator) if distinct else \
            sample(child[:, None].expand(batch, len(kids), child.shape[-1]), generator, check=False)
        tokens[:, kids[0] : kids[0] + len(kids)] = drawn  # siblings are numbered consecutively, in rank order
    return Proposals.shared(tree, tokens[:, 1:], q_draft, without_replacement=distinct)

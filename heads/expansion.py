"""Depth-by-depth tree expansion, shared by the drafters that run a causal model over their own KV cache
(``DraftModel``, ``Eagle``).

One ``propose`` is one forward over the committed tokens the drafter has not seen yet (ending with the
root), whose last output gives the root's children, then one forward per depth over the nodes chosen
to have children. Each expanded node attends to the cached context, its expanded ancestors and itself
(inside its window on a sliding-window layer: ``treespec.cache.attention_masks``) at position root + depth,
so its output equals a sequential decode of its path (SpecInfer, Miao et al. 2024). Children are chosen in
one of two ways:

* a static ``Tree``: node i's children are the top-k ranks its tree paths name (deterministic), or
  i.i.d. samples from the draft distribution (``candidates="sample"`` at temperature > 0; ``q_draft``
  is returned for the walker's multi-candidate rejection rule), or distinct samples drawn without
  replacement (``candidates="without_replacement"``: Gumbel-top-k, verified by recursive rejection
  sampling, Jeon et al. 2024);
* a ``DynamicTree`` (EAGLE-2, Li et al. 2024b): at each depth the ``top_k`` newest nodes with the highest
  cumulative draft log-probability are expanded, each proposing its ``top_k`` likeliest children;
  ``DynamicTree.select`` then keeps the best ``total_tokens`` nodes as a connected Tree whose ranks
  follow draft probability, so the walker tries siblings in that order (deterministic candidates).

``accept`` compacts the drafter's cache to the committed sequence: expanded nodes on the accepted path
stay cached when their keys/values are what a sequential decode would hold (``keeps_expanded_path``),
everything else is dropped (treespec/cache.py).
"""

from __future__ import annotations

import torch

from treespec.cache import attention_masks, keep_tree_path
from treespec.drafter import CANDIDATE_MODES, SAMPLED_CANDIDATES, Drafter, Proposal
from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling, probs, sample, sample_without_replacement, top_k
from treespec.tree import Tree


class GrownNodes:
    """The nodes of one step's tree as the drafter grows it: 0 is the root, every parent precedes its
    children. ``lineage[i]`` is the set of node i and its ancestors (what node i may attend to)."""

    def __init__(self):
        self.parents, self.depths, self.tokens = [-1], [0], [0]
        self.lineage: list[frozenset[int]] = [frozenset({0})]

    @classmethod
    def of_tree(cls, tree: Tree) -> GrownNodes:
        """All nodes of a static tree, tokens still unknown (filled depth by depth)."""
        nodes = cls()
        for i in range(1, tree.num_nodes):
            nodes.add(int(tree.parents[i]), 0)
        return nodes

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.tokens.append(token)
        self.lineage.append(self.lineage[parent] | {len(self.tokens) - 1})
        return len(self.tokens) - 1


class ExpandingDrafter(Drafter):
    """Base class. A subclass sets ``self.model`` (with ``.device`` and ``.dtype``) and implements
    ``_new_cache``, ``_start`` and ``_forward_nodes``; this class grows the tree and keeps its cache."""

    grows_dynamic_trees = True

    #: keep the accepted path's expanded entries in the cache; False when they were computed from inputs
    #: the committed sequence must not keep (EAGLE refeeds accepted tokens with the target's features)
    keeps_expanded_path: bool = True

    def __init__(self, model, default_tree, candidates: str = "topk"):
        """candidates: "topk" (deterministic ranks), "sample" (i.i.d. from q_draft when temperature > 0) or
        "without_replacement" (distinct siblings drawn one after another from q_draft)."""
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"candidates must be one of {CANDIDATE_MODES}, got {candidates!r}")
        self.model = model.eval()
        self.default_tree = default_tree
        self.candidates = candidates
        self.reset()

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.n_cached = 0                   # cache entries of committed tokens
        self._expanded: list[int] = []      # grown nodes whose keys/values follow them, in cache order
        self._grown_of: list[int] = []      # grown node of each node of the last proposal's tree

    # -- what a subclass provides ------------------------------------------------------------------
    def _new_cache(self):
        raise NotImplementedError

    def _start(self, committed: torch.Tensor, feature: torch.Tensor | None) -> torch.Tensor:
        """Feed the committed tokens not cached yet (the root last), add them to ``n_cached`` and return
        the draft logits at the root [1, V]."""
        raise NotImplementedError

    def _fill_for_timing(self, tokens: torch.Tensor) -> None:
        """Feed ``tokens`` [1, m] (placeholders) as committed entries, and make node 0 expandable
        (``drafting_step``)."""
        raise NotImplementedError

    def _forward_nodes(self, tokens: torch.Tensor, nodes: list[int], parents: list[int],
                       attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One cached forward over grown ``nodes`` (tokens [F], their ``parents``) with the mask of
        ``treespec.cache.attention_masks`` (float [1, 1, F, cached + K]; a dict of them keyed by layer type
        when sliding and full layers differ) and positions [1, F] → draft logits at those nodes [F, V]."""
        raise NotImplementedError

    # -- the expansion ---------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None) -> Proposal:
        logits = self._start(committed, feature)  # [1, V]
        self._expanded = []
        if isinstance(tree, DynamicTree):
            if self.candidates in SAMPLED_CANDIDATES and not sampling.greedy:
                raise ValueError(f"{tree!r} grows deterministic top-k candidates; candidates={self.candidates!r} "
                                 "needs a static Tree")
            return self._grow_dynamic(logits, tree)
        return self._grow_static(logits, tree, sampling, generator)

    def _expand(self, nodes: GrownNodes, frontier: list[int]) -> torch.Tensor:
        """Draft logits [F, V] at the ``frontier`` nodes, whose keys/values join the cache after the
        nodes expanded before them; each sees its expanded ancestors and itself."""
        device = self.model.device
        kv_nodes = self._expanded + frontier
        allowed = torch.tensor([[k in nodes.lineage[f] for k in kv_nodes] for f in frontier])  # [F, K]
        root_position = self.n_cached - 1
        positions = torch.tensor([root_position + nodes.depths[k] for k in kv_nodes], device=device)  # [K]
        logits = self._forward_nodes(
            torch.tensor([nodes.tokens[f] for f in frontier], device=device),
            frontier,
            [nodes.parents[f] for f in frontier],
            attention_masks(self.cache, allowed, self.n_cached, positions, dtype=self.model.dtype, device=device),
            positions[None, len(self._expanded) :],  # [1, F]
        )
        self._expanded = kv_nodes
        return logits

    def _grow_static(self, logits, tree: Tree, sampling: Sampling, generator) -> Proposal:
        draw = self.candidates in SAMPLED_CANDIDATES and not sampling.greedy
        distinct = draw and self.candidates == "without_replacement"
        nodes = GrownNodes.of_tree(tree)
        q_draft = torch.zeros(tree.num_nodes, logits.shape[-1], device=logits.device) if draw else None  # [N, V]
        frontier = [0]
        for depth in range(1, tree.depth + 1):
            q = probs(logits, sampling) if draw else None  # [F, V]: draft distribution at each frontier node
            kids_of_depth, picks = [], []
            for row, node in enumerate(frontier):
                kids = tree.children[node]
                if not kids:
                    continue
                if draw:
                    q_draft[node] = q[row]
                    picks.append(sample_without_replacement(q[row], len(kids), generator) if distinct else
                                 sample(q[row].expand(len(kids), -1), generator))
                else:  # the rank-r child is the r-th most likely draft token
                    ranks = tree.ranks[kids]
                    picks.append(top_k(logits[row], int(ranks.max()) + 1)[ranks.to(logits.device)])
                kids_of_depth += kids
            for kid, token in zip(kids_of_depth, torch.cat(picks).tolist(), strict=True):  # one host sync per depth
                nodes.tokens[kid] = token
            if depth == tree.depth:
                break
            frontier = [i for i in tree.levels[depth] if tree.children[i]]  # cached per tree: no tensor ops
            if not frontier:
                break
            logits = self._expand(nodes, frontier)
        self._grown_of = list(range(tree.num_nodes))
        return Proposal(tree=tree, tokens=torch.tensor(nodes.tokens[1:], dtype=torch.long), q_draft=q_draft,
                        without_replacement=distinct)

    def _grow_dynamic(self, logits, policy: DynamicTree) -> Proposal:
        nodes = GrownNodes()
        ranks, scores = [0], [0.0]  # rank among siblings, cumulative draft log-probability
        k = min(policy.top_k, logits.shape[-1])
        frontier = [0]
        for depth in range(1, policy.depth + 1):
            top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [F, k], descending
            children = []
            for parent, log_q, tokens in zip(frontier, top.values.tolist(), top.indices.tolist(), strict=True):
                for rank, (lq, token) in enumerate(zip(log_q, tokens, strict=True)):
                    children.append(nodes.add(parent, token))
                    ranks.append(rank)
                    scores.append(policy.child_score(scores[parent], lq))
            if depth == policy.depth:
                break
            frontier = policy.frontier(children, scores)
            logits = self._expand(nodes, frontier)
        tree, self._grown_of = policy.select(nodes.parents, ranks, scores)
        tokens = torch.tensor([nodes.tokens[i] for i in self._grown_of[1:]], dtype=torch.long)
        return Proposal(tree=tree, tokens=tokens)

    @torch.no_grad()
    def drafting_step(self, past_len: int = 256, n_tokens: int = 4):
        """One expansion depth as the drafter drafts (lean or not): ``n_tokens`` frontier nodes, children of the
        root, through its model and head after ``past_len`` cached placeholder entries, attending to all of them.
        Each call leaves the cache as it found it; ``reset()`` when done with it."""
        device = self.model.device
        self.reset()
        self._fill_for_timing(torch.zeros(1, past_len, dtype=torch.long, device=device))
        self.n_cached = past_len
        tokens = torch.zeros(n_tokens, dtype=torch.long, device=device)  # [F]
        mask = torch.zeros(1, 1, n_tokens, past_len + n_tokens, dtype=self.model.dtype, device=device)  # sees all
        positions = torch.arange(past_len, past_len + n_tokens, device=device)[None]  # [1, F]
        nodes, parents = list(range(1, n_tokens + 1)), [0] * n_tokens

        @torch.no_grad()
        def depth():
            self._forward_nodes(tokens, nodes, parents, mask, positions)
            self.cache.crop(-n_tokens)  # transformers 5: a negative count removes the newest entries

        return depth

    def accept(self, path: torch.Tensor, features) -> None:
        # Expanded nodes on the accepted path form a prefix of it (nodes are expanded depth by depth), in
        # cache order; path tokens not kept here are fed again by the next _start.
        keep = []
        if self.keeps_expanded_path:
            on_path = {self._grown_of[i] for i in path.tolist()}
            keep = [j for j, node in enumerate(self._expanded) if node in on_path]
        keep_tree_path(self.cache, self.n_cached, keep)
        self.n_cached += len(keep)
        self._expanded = []


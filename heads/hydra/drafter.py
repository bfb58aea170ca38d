"""The Hydra drafter (heads/hydra/network.py: the heads): a static tree filled depth by depth, each node's children
from the head of its depth on the base state and the embeddings of the node's own path, and the heads' per-depth
rank accuracy.

Depth d's frontier (the nodes of depth d − 1 that have children) is one batched call of head d − 1: its inputs are
the base state [b, h] beside each frontier node's path embeddings [b, F, d, h], gathered from the tokens drafted so
far. Children are the top ranks the tree names (deterministic candidates), or i.i.d. draws from the head's
distribution at the node (``candidates="sample"``) or draws without replacement (``"without_replacement"``), whose
distributions go to the walker as ``q_draft``: all three are lossless (treespec/walker.py). Everything stays on the
device; what the gathers need (which node is whose ancestor, which child has which rank) is the tree's shape,
known on the host and uploaded once per tree and depth.

With prefix attention the base state is the extra decoder layer's output at the position before the root. The
layer keeps its own KV cache over the target's hidden states, one entry per committed position: the prompts' at
``prefill``, each step's root and accepted nodes at ``accept`` (their target hidden states, what a sequential
decode would feed it), so a step runs the layer once over the new positions only. Its rows are laid out as
the target's are (a ``RowSlots``: treespec/rows.py), so a batch whose rows accept different numbers of tokens stays
exact.
"""

from __future__ import annotations

import torch

from treespec.cache import TreeCache
from treespec.drafter import CANDIDATE_MODES, SAMPLED_CANDIDATES, Drafter, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.drafting.lean import LeanProjection
from treespec.heads.hydra.network import HydraHeads
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.target_states import target_hidden
from treespec.rows import RowSlots, gather_last, right_aligned
from treespec.sampling import GREEDY, Sampling, probs, sample, sample_without_replacement, top_k
from treespec.tree import Tree
from treespec.visibility import causal_rows, slots_mask


class Hydra(Drafter):
    """The drafter: a static tree, depth by depth, each node's children conditioned on its own path."""

    needs_features = True
    per_row = ("slots", "_base")

    def __init__(self, heads: HydraHeads, *, default_tree: Tree | None = None, candidates: str = "topk",
                 lean: bool = True):
        """candidates: "topk", "sample" or "without_replacement" (module docstring). lean: heads sharing the target's
        lm_head project through a lean projection of it (heads/drafting/lean.py)."""
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"candidates must be one of {CANDIDATE_MODES}, got {candidates!r}")
        if default_tree is not None and not isinstance(default_tree, Tree):
            raise ValueError(f"Hydra drafts static trees; default_tree {default_tree!r} is not a Tree")
        self.heads = heads.eval()
        self.candidates = candidates
        self.max_tree_depth = heads.num_heads  # head k fills depth k + 1
        self.max_tree_depth_note = (f"its {heads.num_heads} heads fill one depth each; give a tree of depth <= "
                                    f"{heads.num_heads}, or train more heads (drafter.num_heads in "
                                    f"conf/drafter/hydra.yaml: scripts/train_heads.py drafter=hydra)")
        self.default_tree = default_tree if default_tree is not None else Tree.chain(min(3, heads.num_heads))
        shared = heads.shared_lm_head
        self._lean = LeanProjection.of(shared) if lean and shared is not None else None
        self._plans: dict = {}  # (tree, depth) → device index tensors of that depth's gathers
        self.reset()

    def check_target(self, target) -> None:
        self.heads.check_fits(target)
        self.heads.to(device=target.device, dtype=target.dtype)  # heads built or loaded for another dtype
        if self._lean is not None:
            self._lean.to(device=target.device, dtype=target.dtype)

    # -- the prefix layer's cache (prefix attention only) ------------------------------------------------------
    def reset(self) -> None:
        prefix = self.heads.prefix is not None
        self.cache = TreeCache(self.heads.layer_config) if prefix else None
        self.slots: RowSlots | None = None
        self._base: torch.Tensor | None = None  # [b, h]: the base state at each row's newest fed position

    def _feed(self, features: torch.Tensor, counts: list[int]) -> None:
        """Run the prefix layer over ``features`` [b, m, h] (row b's first ``counts[b]`` valid), after its cache, and
        keep each row's output at its last valid entry as the next base state."""
        heads = self.heads
        if self.slots is None:
            self.slots = RowSlots(len(counts), heads.device, self.cache)
        width, kwargs = features.shape[1], {}
        if self.slots.ragged or any(c != width for c in counts):  # each row its own mask and positions
            allowed = causal_rows(counts, width, heads.device)  # [b, m, m]
            kwargs = {"attention_mask": slots_mask(self.slots, allowed, dtype=heads.dtype),
                      "position_ids": self.slots.positions(torch.arange(width))}
        base = heads.base(features.to(heads.device, heads.dtype), cache=self.cache, **kwargs)  # [b, m, h]
        self.slots.append(width, counts)
        self._base = gather_last(base, counts)

    @torch.no_grad()
    def prefill(self, input_ids, features, attention_mask=None) -> None:
        if self.heads.prefix is None:
            return
        lengths = [input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None else \
            attention_mask.sum(-1).tolist()  # (the mask is the caller's host input)
        self._feed(right_aligned(features, lengths)[:, : max(lengths)], lengths)

    @torch.no_grad()
    def accept(self, paths, features) -> None:
        if self.heads.prefix is None:
            return
        # the root's hidden state, then each accepted node's (in a Combined, another drafter's nodes too)
        counts = [len(path) + 1 for path in paths]
        self._feed(features[:, : max(counts)], counts)

    # -- drafting ------------------------------------------------------------------------------------------------
    def _project(self, k: int, x: torch.Tensor) -> torch.Tensor:
        return self._lean(x) if self._lean is not None else self.heads.project(k, x)

    def _plan(self, tree: Tree, depth: int) -> tuple:
        """Depth ``depth``'s gathers, made once per tree: each frontier node's path (its ancestors from the root, then
        itself) [F, depth], and for each node of the depth its parent's frontier index and its rank."""
        key = (tree, depth)
        if key not in self._plans:
            device = self.heads.device
            frontier = [i for i in tree.levels[depth - 1] if tree.children[i]]
            paths = []
            for node in frontier:
                path = [node]
                while path[-1] != 0:
                    path.append(tree.parent_list[path[-1]])
                paths.append(path[::-1])
            level = tree.levels[depth]
            parent_at = {node: j for j, node in enumerate(frontier)}
            self._plans[key] = (frontier, torch.tensor(paths, device=device),
                                torch.tensor([parent_at[tree.parent_list[i]] for i in level], device=device),
                                torch.tensor([tree.rank_list[i] for i in level], device=device))
        return self._plans[key]

    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None) -> Proposals:
        if isinstance(tree, DynamicTree):
            raise ValueError(f"Hydra drafts static trees; {tree!r} is a dynamic tree (EAGLE-2's): give a Tree")
        if tree.depth > self.heads.num_heads:
            raise ValueError(f"{tree!r} is deeper than Hydra can fill: {self.max_tree_depth_note}")
        heads = self.heads
        draw = self.candidates in SAMPLED_CANDIDATES and not sampling.greedy
        distinct = draw and self.candidates == "without_replacement"
        base = feature.to(heads.device, heads.dtype) if heads.prefix is None else self._base  # [b, h]
        batch = base.shape[0]
        last = torch.tensor(committed.lengths, device=committed.tokens.device)[:, None] - 1  # (host lengths: no read)
        tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.long, device=heads.device)  # [b, N], node 0 the root
        tokens[:, :1] = committed.tokens.gather(1, last).to(heads.device)
        q_draft = None
        for depth in range(1, tree.depth + 1):
            frontier, paths, parent_of, ranks = self._plan(tree, depth)
            path = heads.embed(tokens[:, paths])  # [b, F, depth, h]
            x = heads.head_out(depth - 1, base[:, None].expand(-1, len(frontier), -1), path)  # [b, F, h]
            logits = self._project(depth - 1, x)  # [b, F, V]
            level = tree.levels[depth]
            if draw:
                q = probs(logits, sampling)  # [b, F, V]
                if q_draft is None:
                    q_draft = q.new_zeros(batch, tree.num_nodes, q.shape[-1])  # [b, N, V]
                q_draft[:, frontier] = q
                if distinct:  # each node's children in draw order, distinct, one frontier node at a time
                    picks = torch.cat([sample_without_replacement(q[:, j], len(tree.children[node]), generator)
                                       for j, node in enumerate(frontier)], dim=-1)  # [b, n_d]
                else:  # i.i.d. children: one draw each from its parent's q
                    picks = sample(q.index_select(1, parent_of), generator, check=False)  # [b, n_d]
            else:  # the rank-r child is the r-th most likely token of its parent's head
                top = top_k(logits, int(max(tree.rank_list[i] for i in level)) + 1)  # [b, F, K]
                picks = top[:, parent_of, ranks]  # [b, n_d]
            tokens[:, level[0] : level[-1] + 1] = picks
        return Proposals.shared(tree, tokens[:, 1:], q_draft, without_replacement=distinct)

    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One drafted depth as the drafter runs it: a middle head on ``n_tokens`` frontier nodes per row (placeholder
        base state and paths). It keeps no cache inside a proposal, so ``past_len`` does not apply; the prefix
        layer's one pass per step over the accepted positions is not included."""
        heads = self.heads
        k = heads.num_heads // 2
        base = torch.randn(batch, 1, heads.config["hidden_size"], device=heads.device, dtype=heads.dtype)
        path = heads.embed(torch.zeros(batch, n_tokens, k + 1, dtype=torch.long, device=heads.device))
        return torch.no_grad()(lambda: self._project(k, heads.head_out(k, base.expand(-1, n_tokens, -1), path)))


@torch.no_grad()
def rank_accuracy(target, heads: HydraHeads, windows: torch.Tensor, *, top_k: int = 10, batch_size: int = 8,
                  sampling: Sampling = GREEDY, first_root: int = 0) -> list[list[float]]:
    """acc[k][r]: the chance that head k's rank-r token at t, its path the window's tokens t + 1 .. t + k + 1, is
    the token the target emits after them (heads/training/accuracy.py), teacher forced on ``windows`` [n, s + 1]:
    what an
    accepted path feeds the heads; from root ``first_root`` on."""
    was_training = heads.training
    heads.eval()
    counter = RankHits(heads.num_heads, top_k, sampling)
    for batch in windows.split(batch_size):
        _, hidden = target_hidden(target, batch[:, :-1])  # [b, s, h]
        target_logits = target.get_output_embeddings()(hidden)  # [b, s, V]: the target's token t + 1
        base = heads.base(hidden.to(heads.dtype))  # [b, s, h]
        first = max(0, first_root - 1)  # head 0 at t guesses t + 2, the target's t + 1 the root
        for k, x in enumerate(head_outputs(heads, base, batch)):  # [b, s - k - 1, h]
            top = heads.project(k, x[:, first:]).topk(top_k, dim=-1).indices  # [b, s-k-1-first, R]
            counter.add(k, top, target_logits[:, k + 1 + first :])
    heads.train(was_training)
    return counter.table()


def head_outputs(heads: HydraHeads, base: torch.Tensor, batch: torch.Tensor):
    """Each head's output before its projection, teacher forced: head k at position t reads ``base[:, t]`` and the
    embeddings of ``batch[:, t + 1 .. t + k + 1]``; base [b, s, h] over ``batch[:, :-1]`` (batch [b, s + 1]) →
    yields [b, s - k - 1, h] for k = 0, 1, ... (positions whose path and next token lie inside the window)."""
    s = base.shape[1]
    embedded = heads.embed(batch[:, 1:])  # [b, s, h]: token t + 1 at t
    for k in range(heads.num_heads):
        n = s - k - 1
        if n <= 0:
            return
        path = torch.stack([embedded[:, j : j + n] for j in range(k + 1)], dim=2)  # [b, n, k + 1, h]
        yield heads.head_out(k, base[:, :n], path)

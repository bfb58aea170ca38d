"""The DFlash drafter (heads/dflash/network.py: what it computes): one pass of its layers over each row's block fills
every depth of the tree at once, a chain or any tree over the block (treespec/block_tree.py: static trees, sampled
candidates, and DDTree's best tree for a ``DynamicTree`` budget).

**The context cache.** Between steps the drafter's cache holds, per layer, the keys and values of the context of
every committed token but the root's and the tokens accepted with it: the target features of the tokens committed
since arrive in ``accept`` (the previous root's and its accepted nodes') and are fed at the start of the next
``propose``, in the same pass as the block, whose own keys never enter the cache. After the prompt the context is
the prompt's features (the first root was sampled from the last of them). Rows of a batch hold different numbers
of entries on one slot axis (treespec/rows.py), so padding and holes are masked and each row's positions are its
own; a batch whose rows are alike takes no mask at all (the block sees everything).
"""

from __future__ import annotations

import torch

from treespec.block_tree import dynamic_block_proposals, static_block_proposals
from treespec.cache import TreeCache
from treespec.drafter import CANDIDATE_MODES, SAMPLED_CANDIDATES, Drafter, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.accuracy import RankHits
from treespec.heads.dflash.network import DFlashModel
from treespec.heads.lean import LeanProjection
from treespec.heads.target_states import target_states
from treespec.heads.vocab import DraftVocab, ReducedHead
from treespec.rows import RowSlots, right_aligned
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree
from treespec.visibility import slots_mask


class DFlash(Drafter):
    """The drafter: one forward of its layers over every row's block per step (module docstring). Default tree: the
    block as a chain, Tree.chain(block_size − 1), as z-lab decodes; a static tree, or a DynamicTree budget grown
    as DDTree's best tree, over the same block."""

    needs_features = True
    fills_tree_at_once = True
    grows_dynamic_trees = True

    def __init__(self, model: DFlashModel, *, default_tree: Tree | DynamicTree | None = None,
                 candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True):
        """candidates: "topk", "sample" or "without_replacement" (static trees at temperature > 0: each node's
        children drawn from its next depth's distribution). draft_vocab: project onto these target ids only (FR-Spec,
        heads/vocab.py; still lossless). lean: the target's lm_head through a transposed copy (heads/lean.py)."""
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"candidates must be one of {CANDIDATE_MODES}, got {candidates!r}")
        self.model = model.eval()
        self.candidates = candidates
        self.feature_layers = model.feature_layers
        self.max_tree_depth = model.block_size - 1
        self.default_tree = default_tree if default_tree is not None else Tree.chain(model.block_size - 1)
        head = model.lm_head
        if draft_vocab is not None:
            self._head = ReducedHead(head, draft_vocab, lean=lean)
        else:
            self._head = LeanProjection.of(head) if lean else head
        self.reset()

    def check_target(self, target) -> None:
        self.model.check_fits(target)

    def reset(self) -> None:
        self.cache = TreeCache(self.model.layer_config)  # the context's keys and values, per layer
        self.slots: RowSlots | None = None  # the cache's rows; made for the first batch
        self._pending: torch.Tensor | None = None  # [b, m, K·H]: target features of committed tokens not fed yet
        self._pending_counts: list[int] = []  # row b's are the first _pending_counts[b]

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.slots is not None:  # else nothing is cached yet
            self.slots.select(rows, self.cache)
        if self._pending is not None:
            self._pending = self._pending.index_select(0, rows.to(self._pending.device))
            self._pending_counts = [self._pending_counts[b] for b in rows.tolist()]

    @torch.no_grad()
    def prefill(self, input_ids, features, attention_mask=None) -> None:
        # every prompt token's feature is context of the first root (the token its last one produced)
        lengths = [input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None else \
            attention_mask.sum(-1).tolist()
        self._pending = right_aligned(features, lengths)[:, : max(lengths)]
        self._pending_counts = lengths

    @torch.no_grad()
    def accept(self, paths, features) -> None:
        # the previous root and every accepted token (another drafter's in a Combined too) now have features
        self._pending_counts = [1 + len(path) for path in paths]
        self._pending = features[:, : max(self._pending_counts)]

    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None) -> Proposals:
        held = self._rows(len(committed.lengths)).counts
        context = [c + p for c, p in zip(held, self._pending_counts, strict=False)]
        if [n - 1 for n in committed.lengths] != context:
            raise RuntimeError(f"DFlash drafter out of sync: {[n - 1 for n in committed.lengths]} committed tokens "
                               f"before the roots but {context} in the context (was accept() called after every "
                               "propose()?)")
        device = self.model.device
        index = torch.tensor(committed.lengths, device=committed.tokens.device)[:, None] - 1
        roots = committed.tokens.gather(1, index)[:, 0].to(device)  # [b]: on the device, no read
        logits = self._head(self._block(roots)[:, 1:])  # [b, block_size − 1, V]: depth d's at d − 1
        if isinstance(tree, DynamicTree):
            if self.candidates in SAMPLED_CANDIDATES and not sampling.greedy:
                raise ValueError(f"{tree!r} grows deterministic top-k candidates; candidates={self.candidates!r} "
                                 "needs a static Tree")
            return dynamic_block_proposals(logits, tree)
        if tree.depth > self.max_tree_depth:
            raise ValueError(f"{tree!r} is deeper than the {self.max_tree_depth} positions a DFlash block of "
                             f"{self.model.block_size} fills")
        return static_block_proposals(logits, tree, sampling, self.candidates, generator)

    def _rows(self, batch: int) -> RowSlots:
        if self.slots is None:
            self.slots = RowSlots(batch, self.model.device)
        return self.slots

    def _block(self, roots: torch.Tensor) -> torch.Tensor:
        """The pending context fed, then each row's block rooted at ``roots`` [b] → outputs [b, block_size, H]."""
        slots, counts = self.slots, self._pending_counts
        width = max(counts, default=0)
        size = self.model.block_size
        features = None if width == 0 else self._pending[:, :width].to(self.model.device)
        context_positions = slots.positions(torch.arange(width))  # [b or 1, width]: after each row's held entries
        mask = None
        if slots.ragged or any(c != width for c in counts):  # each row sees its own entries, then its whole block
            fed = torch.arange(width, device=self.model.device)[None] < torch.tensor(counts, device=self.model.device)[
                :, None]  # [b, width]
            allowed = torch.cat([fed, torch.ones_like(fed[:, :1]).expand(-1, size)], dim=1)[:, None].expand(
                -1, size, -1)  # [b, size, width + size]
            mask = slots_mask(slots, allowed, dtype=self.model.dtype)
        slots.append(width, counts)
        self._pending, self._pending_counts = None, []
        positions = slots.positions(torch.arange(size))  # [b or 1, size]: the root's position on
        return self.model(self.model.block_ids(roots), features, positions, context_positions, mask, self.cache)

    @torch.no_grad()
    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One proposal's pass as the drafter runs it (lean or not): every row's block and its head after
        ``past_len`` cached context entries (it fills the whole tree in one call; ``n_tokens`` does not apply).
        Each call leaves the cache as it found it; ``reset()`` when done with it."""
        device = self.model.device
        self.reset()
        self._rows(batch)
        width = len(self.feature_layers) * self.model.fc.out_features
        self._pending = torch.zeros(batch, past_len, width, dtype=self.model.dtype, device=device)
        self._pending_counts = [past_len] * batch
        roots = torch.zeros(batch, dtype=torch.long, device=device)
        self._block(roots)  # the context, cached
        blocks = self.model.block_ids(roots)
        positions = self.slots.positions(torch.arange(self.model.block_size))

        @torch.no_grad()
        def step():
            return self._head(self.model(blocks, None, positions, cache=self.cache)[:, 1:])

        return step


@torch.no_grad()
def rank_accuracy(target, model: DFlashModel, windows: torch.Tensor, *, depth: int | None = None, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY, first_root: int = 0,
                  anchors_per_pass: int = 64) -> list[list[float]]:
    """acc[d][r] (heads/accuracy.py): the chance that the block's rank-r token at depth d + 1 is the one the target
    emits, teacher forced on held-out ``windows`` [n, S]: a block rooted at every position from ``first_root`` on
    (and >= 1: decoding always has context) whose depth d + 1 lies in the window. ``depth``: at most
    block_size − 1 (None: that)."""
    size = model.block_size
    depth = size - 1 if depth is None else min(int(depth), size - 1)
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    for batch in windows.split(batch_size):
        batch = batch.to(model.device)
        features, target_logits = target_states(target, batch, model.feature_layers)  # [b, S, K·H], [b, S, V]
        s = batch.shape[1]
        roots = torch.arange(max(1, first_root), s - 1, device=batch.device)
        for chunk in roots.split(anchors_per_pass):
            out = model.anchored(batch, features, chunk[None].expand(batch.shape[0], -1))  # [b, m, size, H]
            top = model.logits(out[:, :, 1 : depth + 1]).topk(top_k, dim=-1).indices  # [b, m, D, R]
            for d in range(depth):
                keep = chunk + d + 1 < s  # depth d + 1 from root a guesses token a + d + 1
                if keep.any():
                    counter.add(d, top[:, keep, d], target_logits[:, chunk[keep] + d])
    model.train(was_training)
    return counter.table()

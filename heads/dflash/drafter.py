"""The DFlash drafter (heads/dflash/network.py: what it computes): one pass of its layers over each row's block fills
every depth of the tree at once, a chain or any tree over the block (treespec/block_tree.py: static trees, sampled
candidates, and DDTree's best tree for a ``DynamicTree`` budget).

**The context cache.** Between steps the drafter's cache holds, per layer, the keys and values of the context of
every committed token but the root: the prompt's at ``prefill`` (the first root was sampled from the last of its
features), then at each ``accept`` the previous root's and its accepted tokens' (their target features arrive with
it). A layer's context keys and values are projections of the features alone (heads/dflash/block_layer.py), so
adding them runs no layer; ``propose`` is one pass of the layers over every row's block, whose own keys never enter
the cache. Rows of a batch hold different numbers of entries on one slot axis (treespec/rows.py), so padding and
holes are masked and each row's positions are its own; rows that hold alike take no mask at all (the block sees
everything).

**Context added when it is needed.** ``accept`` only holds the new features; the next ``propose`` (or ``keep_rows``)
adds everything held in one call. As a fallback member of a Combined drafter DFlash is asked only on some steps
(``proposes_on_demand``), and adding three steps' few tokens at once costs about what adding one step's did: the
projections read their weights once per call.
"""

from __future__ import annotations

import torch

from treespec.block_tree import block_proposals
from treespec.cache import TreeCache
from treespec.drafter import CANDIDATE_MODES, Drafter, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.dflash.network import DFlashModel
from treespec.heads.drafting.lean import LeanProjection
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.target_states import target_states
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
    per_row = ("slots",)  # (None: nothing cached yet; keep_rows adds what accept() held first)
    proposes_on_demand = True  # a block is a function of the context accept() keeps: a skipped step costs nothing

    def __init__(self, model: DFlashModel, *, default_tree: Tree | DynamicTree | None = None,
                 candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True):
        """candidates: "topk", "sample" or "without_replacement" (static trees at temperature > 0: each node's
        children drawn from its next depth's distribution). draft_vocab: project onto these target ids only (FR-Spec,
        heads/drafting/vocab.py; still lossless); None: the model's training vocabulary if it has one, else all.
        lean: the target's lm_head through a lean projection
        (heads/drafting/lean.py: oneDNN's blocked layout on CPUs)."""
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"candidates must be one of {CANDIDATE_MODES}, got {candidates!r}")
        self.model = model.eval()
        self.candidates = candidates
        self.feature_layers = model.feature_layers
        self.max_tree_depth = model.block_size - 1
        self.default_tree = default_tree if default_tree is not None else Tree.chain(model.block_size - 1)
        head = model.lm_head
        draft_vocab = model.vocab if draft_vocab is None else draft_vocab  # a block trained on N tokens drafts those
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
        self._held: list[tuple[torch.Tensor, list[int]]] = []  # accept()'s features and counts, not added yet

    @torch.no_grad()
    def prefill(self, input_ids, features, attention_mask=None) -> None:
        # every prompt token's feature is context of the first root (the token its last one produced)
        lengths = [input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None else \
            attention_mask.sum(-1).tolist()
        self._add(right_aligned(features, lengths)[:, : max(lengths)], lengths)

    @torch.no_grad()
    def accept(self, paths, features) -> None:
        # the previous root and every accepted token (another drafter's in a Combined too) now have features; they
        # join the context when it is next read (module docstring)
        counts = [1 + len(path) for path in paths]
        # a copy: a compiled static pass hands out features in buffers it writes again next step
        self._held.append((features[:, : max(counts)].clone(), counts))

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._add_held()
        super().keep_rows(rows)

    @torch.no_grad()
    def _add_held(self) -> None:
        """Add every feature ``accept`` held to the context, in one call: row b's entries of each step in turn."""
        if not self._held:
            return
        if len(self._held) == 1:
            features, counts = self._held[0]
        else:
            counts = [sum(step[b] for _, step in self._held) for b in range(len(self._held[0][1]))]
            first = self._held[0][0]
            features = first.new_zeros(first.shape[0], max(counts), first.shape[2])  # [b, Σ counts, K·H]
            for b in range(first.shape[0]):
                features[b, : counts[b]] = torch.cat([held[b, : step[b]] for held, step in self._held])
        self._held = []
        self._add(features, counts)

    def _add(self, features: torch.Tensor, counts: list[int]) -> None:
        """Row b's first ``counts[b]`` of ``features`` [b, m, K·H] join its context, after what it holds."""
        slots = self._rows(features.shape[0])
        width = features.shape[1]
        positions = slots.positions(torch.arange(width))  # [b or 1, m]: after each row's held entries
        self.model.add_context(features.to(self.model.device), positions, self.cache)
        slots.append(width, counts)

    def _rows(self, batch: int) -> RowSlots:
        if self.slots is None:
            self.slots = RowSlots(batch, self.model.device, self.cache)
        return self.slots

    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None) -> Proposals:
        self._add_held()
        held = self._rows(len(committed.lengths)).counts
        if held != [n - 1 for n in committed.lengths]:
            raise RuntimeError(f"DFlash drafter out of sync: {[n - 1 for n in committed.lengths]} committed tokens "
                               f"before the roots but {held} in the context (was accept() called after every "
                               "propose()?)")
        index = torch.tensor(committed.lengths, device=committed.tokens.device)[:, None] - 1
        roots = committed.tokens.gather(1, index)[:, 0].to(self.model.device)  # [b]: on the device, no read
        # the head over the depths the tree reaches only (a deeper tree is refused below, naming the block's)
        depth = min(tree.depth, self.max_tree_depth)
        logits = self._head(self._block(roots, feature)[:, 1 : 1 + depth])  # [b, D, V]: depth d's at d − 1
        return block_proposals(logits, tree, sampling, self.candidates, generator,
                               what=f"a DFlash block of {self.model.block_size}")

    def _block(self, roots: torch.Tensor, feature: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's block rooted at ``roots`` [b] over its cached context → outputs [b, block_size, H];
        ``feature`` [b, K·H]: the target's that produced each root (read with ``root_feature`` only)."""
        size = self.model.block_size
        mask = None
        if self.slots.ragged:  # each row sees its own entries, then its whole block
            allowed = torch.ones(1, size, size, dtype=torch.bool, device=self.model.device)
            mask = slots_mask(self.slots, allowed, dtype=self.model.dtype)
        positions = self.slots.positions(torch.arange(size))  # [b or 1, size]: the root's position on
        root_features = None  # [b, 1, K·H]: read by a block with root_feature only
        if self.model.root_norm is not None and feature is not None:
            root_features = feature[:, None].to(self.model.device)
        return self.model(self.model.block_ids(roots), None, positions, attention_mask=mask, cache=self.cache,
                          root_features=root_features)

    @torch.no_grad()
    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One proposal's pass as the drafter runs it (lean or not): every row's block and its head after
        ``past_len`` cached context entries (it fills the whole tree in one call; ``n_tokens`` does not apply).
        Calls leave the cache as they found it; ``reset()`` when done with it."""
        device = self.model.device
        self.reset()
        width = len(self.feature_layers) * self.model.fc.out_features
        self._add(torch.zeros(batch, past_len, width, dtype=self.model.dtype, device=device), [past_len] * batch)
        roots = torch.zeros(batch, dtype=torch.long, device=device)
        feature = torch.zeros(batch, width, dtype=self.model.dtype, device=device)
        return torch.no_grad()(lambda: self._head(self._block(roots, feature)[:, 1:]))


@torch.no_grad()
def rank_accuracy(target, model: DFlashModel, windows: torch.Tensor, *, depth: int | None = None, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY, first_root: int = 0,
                  anchors_per_pass: int = 64) -> list[list[float]]:
    """acc[d][r] (heads/training/accuracy.py): the chance that the block's rank-r token at depth d + 1 is the one the
    target
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
            counter.add_blocks(top, chunk, target_logits)
    model.train(was_training)
    return counter.table()

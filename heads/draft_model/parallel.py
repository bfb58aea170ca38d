"""PARD (An et al., ICLR 2026, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation"): a
draft model adapted to fill k positions in one forward pass. After the committed tokens it is fed k − 1 mask tokens
(one placeholder id, ``pard_token``); with its ordinary causal attention, the output at the root and at mask j gives
the distribution of the token at depth 1 and depth j + 1. Those k distributions do not depend on the tokens drafted
at earlier depths, so any tree over them is filled by treespec/block_tree.py, as DFlash's block is: a chain (the
default), a static tree (top-k ranks or sampled candidates), or DDTree's best tree for a ``DynamicTree`` budget.

**Why PARD and not P-EAGLE.** PARD is the same network as the draft-model kind (a small causal LM of the target's
vocabulary) with the same checkpoint (a transformers folder whose config.json also holds ``pard_token``,
``pard_parallel`` and ``spd_type: pard``, the fields AMD's checkpoints and vLLM read); it is adapted from a trained
draft model by treespec's draft-model training (heads/draft_model/pard_objective.py); it reads no target features,
so one PARD model serves every target of its vocabulary. P-EAGLE's parallel heads need the target's hidden states,
an EAGLE checkpoint per target and a training of their own.

**The cache.** Between steps the draft's cache holds committed tokens only, as a plain draft model's does after its
``accept``. One ``propose`` is one forward over [each row's committed tokens not cached yet (the root last), mask ×
(k − 1)]; then the mask entries (and a ragged batch's padding) are dropped (``RowSlots.keep``: the fed tokens are a
chain prefix, so nothing moves), and the next step feeds the accepted tokens, whichever drafter of a Combined
proposed them. Rows of a batch hold different numbers of entries on one slot axis (treespec/rows.py): their fed
tokens are right-padded, each mask sees its row's valid slots and its own earlier masks at its row's positions.
A draft with recurrent layers is refused (the masks would enter a state that cannot drop them); sliding-window
drafts work one prompt at a time, as the draft model's expansion does.

Nothing is read back while a static tree is filled; a dynamic one reads its top-k log-probabilities once.
"""

from __future__ import annotations

import numbers

import torch

from treespec.block_tree import block_proposals
from treespec.heads.draft_model.drafter import DraftModel
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.segments import segment_causal
from treespec.heads.training.target_states import target_states
from treespec.rows import gather_positions
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree
from treespec.visibility import causal_rows, relation_mask, slots_mask

#: the positions a PARD model fills when its config does not say (AMD's checkpoints are trained with 8)
DEFAULT_PARALLEL = 8


def check_parallel(parallel, mask_token_id, vocab_size: int) -> None:
    """Refuse a PARD setting, naming it: ``parallel`` (k) an integer >= 2, the mask token an id of the draft's
    vocabulary (its ``vocab_size`` embedding rows)."""
    if isinstance(parallel, bool) or not isinstance(parallel, numbers.Integral) or parallel < 2:
        raise ValueError(f"PARD's parallel (k, the positions one pass fills: the root's and k − 1 masks') must be an "
                         f"integer >= 2, got {parallel!r}")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, numbers.Integral) or \
            not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"PARD's mask token {mask_token_id!r} is not a token id of the draft's vocabulary of "
                         f"{vocab_size} (0 .. {vocab_size - 1})")


def vocab_rows(model) -> int:
    """The token ids ``model`` embeds."""
    return model.get_input_embeddings().weight.shape[0]


def pard_settings(config) -> tuple[int, int] | None:
    """(k, mask token id) of a PARD model's ``config`` (``pard_token``; ``pard_parallel``, else DEFAULT_PARALLEL), or
    None for a plain draft model."""
    token = getattr(config, "pard_token", None)
    if token is None:
        return None
    parallel = getattr(config, "pard_parallel", None)  # 0 was read as the default 8: check_parallel names it
    return DEFAULT_PARALLEL if parallel is None else parallel, token


def mark_pard(model, parallel: int, mask_token_id: int) -> None:
    """Record PARD's settings in ``model``'s config (saved in its config.json): AMD's and vLLM's fields
    (``pard_token``, ``spd_type``) and treespec's ``pard_parallel``."""
    check_parallel(parallel, mask_token_id, vocab_rows(model))
    model.config.pard_token, model.config.pard_parallel, model.config.spd_type = int(mask_token_id), int(parallel), \
        "pard"


class ParallelDraft(DraftModel):
    """A draft model that fills ``parallel`` (k) depths in one pass (module docstring). ``mask_token_id``: the
    placeholder fed after the root (None: the model config's ``pard_token``, else the vocabulary's last id);
    ``parallel`` None: the config's ``pard_parallel``, else 8. Default tree: the chain of the k depths."""

    fills_tree_at_once = True

    def __init__(self, model, *, parallel: int | None = None, mask_token_id: int | None = None,
                 default_tree: Tree | None = None, candidates: str = "topk", draft_vocab: DraftVocab | None = None,
                 lean: bool = True):
        own = pard_settings(model.config) or (DEFAULT_PARALLEL, vocab_rows(model) - 1)
        parallel = own[0] if parallel is None else parallel
        mask_token_id = own[1] if mask_token_id is None else mask_token_id
        check_parallel(parallel, mask_token_id, vocab_rows(model))
        self.parallel, self.mask_token_id = int(parallel), int(mask_token_id)
        super().__init__(model, default_tree=default_tree if default_tree is not None else Tree.chain(self.parallel),
                         candidates=candidates, draft_vocab=draft_vocab, lean=lean)
        if self._path_rows is not None or self._one_token:
            raise ValueError("a PARD draft needs a cache that can drop its mask tokens after each pass: this draft "
                             "model has recurrent layers (a plain DraftModel drafts with it)")
        self.max_tree_depth = self.parallel
        self.max_tree_depth_note = (f"one pass fills {self.parallel} depths (the root's output and "
                                    f"{self.parallel - 1} masks'); a PARD model trained with a larger parallel "
                                    "(scripts/train_heads.py drafter=pard drafter.parallel=...) fills more")

    def compile_steps(self, options, capacity) -> None:
        self._static = None  # one eager pass per step (treespec/static_pass.py compiles the expansion's depths)

    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None):
        logits = self._block(committed)  # [b, k, V]: depth d's at d − 1
        return block_proposals(logits, tree, sampling, self.candidates, generator,
                               what=f"PARD's pass of parallel={self.parallel}")

    def _block(self, committed) -> torch.Tensor:
        """Feed each row's committed tokens not cached yet and k − 1 masks; keep the committed ones cached → the
        draft logits at each row's root and masks [b, k, V]."""
        slots = self._rows(len(committed.lengths))
        pending, counts = committed.tails(slots.counts)  # [b, m]: each row's tokens not yet seen, root last
        device, masks = self.model.device, self.parallel - 1
        width = pending.shape[1]
        ids = torch.cat([pending.to(device), pending.new_full((pending.shape[0], masks), self.mask_token_id,
                                                               device=device)], dim=1)  # [b, m + k − 1]
        keep = torch.tensor([[c - 1] for c in counts])  # each row's root, then its masks
        keep = torch.cat([keep, width + torch.arange(masks).expand(len(counts), -1)], dim=1).to(device)  # [b, k]
        logits = self._logits(ids, **self._block_inputs(counts, width), keep=keep)
        slots.keep([list(range(c)) for c in counts])  # the fed tokens stay; masks and padding go
        return logits

    def _block_inputs(self, counts: list[int], width: int) -> dict:
        """The mask and positions of a pass over ``counts[b]`` committed tokens per row (right-padded to ``width``)
        and the masks after them: none while the rows are alike (causal after the cache); else row b's tokens see
        its valid slots causally, its masks its valid slots, its fed tokens and their own earlier masks, at the
        positions that follow its tokens."""
        masks = self.parallel - 1
        if not self.slots.ragged and all(c == width for c in counts):
            return {}
        device, n = self.model.device, width + masks
        allowed = torch.zeros(len(counts), n, n, dtype=torch.bool, device=device)
        allowed[:, :width, :width] = causal_rows(counts, width, device)
        fed = torch.arange(width, device=device)[None] < torch.tensor(counts, device=device)[:, None]  # [b, m]
        allowed[:, width:, :width] = fed[:, None, :]
        allowed[:, width:, width:] = torch.ones(masks, masks, dtype=torch.bool, device=device).tril()
        offsets = torch.cat([torch.arange(width).expand(len(counts), -1),
                             torch.tensor(counts)[:, None] + torch.arange(masks)], dim=1)  # [b, n]
        return {"attention_mask": slots_mask(self.slots, allowed, dtype=self.model.dtype),
                "position_ids": self.slots.positions(offsets)}

    def accept(self, paths, features) -> None:
        """Nothing to compact: the cache holds committed tokens only, and the accepted ones are fed next step."""

    @torch.no_grad()
    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One proposal's pass as the drafter runs it (lean or not): the root and k − 1 masks per row after
        ``past_len`` cached entries, and their removal (it fills the whole tree in one call; ``n_tokens`` does not
        apply). Calls leave the cache as they found it; ``reset()`` when done with it."""
        device = self.model.device
        self.reset()
        self._rows(batch)
        self._fill_for_timing(torch.zeros(batch, past_len, dtype=torch.long, device=device))
        self.slots.append(past_len)
        ids = torch.full((batch, self.parallel), self.mask_token_id, dtype=torch.long, device=device)

        @torch.no_grad()
        def step():
            self._logits(ids, keep=torch.arange(self.parallel, device=device).expand(batch, -1))
            self.cache.crop(-self.parallel)  # transformers 5: a negative count removes the newest entries

        return step


# -- many anchored blocks in one pass: training and rank accuracy ----------------------------------------------------
def anchored_hidden(model, input_ids: torch.Tensor, anchors: torch.Tensor, parallel: int, mask_token_id: int,
                    positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """One pass of ``model`` (a causal LM) over a window ``input_ids`` [b, n] followed by k − 1 masks for each of
    its ``anchors`` [b, m] → the final hidden states [b, n + m(k − 1), h]: the window's tokens attend causally (within
    their conversation: ``segments`` [b, n] of a packed batch, whose ``positions`` [b, n] restart with each), and
    anchor a's mask j, at position a + j, to the tokens <= a of a's conversation and to its own masks 1..j — as
    decoding feeds them after the root a. Every position of the window is thereby anchored at depth 1 too (its
    ordinary next-token output)."""
    b, n = input_ids.shape
    m, masks, device = anchors.shape[1], parallel - 1, input_ids.device
    base = torch.arange(n, device=device).expand(b, -1) if positions is None else positions
    segments = torch.zeros_like(input_ids) if segments is None else segments
    j = torch.arange(1, parallel, device=device)
    mask_positions = (base.gather(1, anchors)[:, :, None] + j).flatten(1)  # [b, m(k − 1)]
    ids = torch.cat([input_ids, torch.full_like(mask_positions, mask_token_id)], dim=1)
    size = n + m * masks
    seen = torch.zeros(b, size, size, dtype=torch.bool, device=device)
    seen[:, :n, :n] = segment_causal(segments)
    t = torch.arange(n, device=device)
    context = (t <= anchors[:, :, None]) & (segments[:, None, :] == segments.gather(1, anchors)[:, :, None])
    seen[:, n:, :n] = context.repeat_interleave(masks, dim=1)  # [b, m(k − 1), n]
    own = torch.ones(masks, masks, dtype=torch.bool, device=device).tril()
    seen[:, n:, n:] = torch.kron(torch.eye(m, dtype=torch.long, device=device), own.long()).bool()
    mask = relation_mask(seen, dtype=model.dtype)  # [b, 1, N, N]
    return model.base_model(input_ids=ids, attention_mask=mask, position_ids=torch.cat([base, mask_positions], 1),
                            use_cache=False).last_hidden_state


def anchor_outputs(hidden: torch.Tensor, anchors: torch.Tensor, n: int, parallel: int) -> torch.Tensor:
    """``anchored_hidden``'s outputs [b, N, h] → each anchor's k outputs [b, m, k, h]: its own position's (depth 1),
    then its masks' (depth 2 .. k)."""
    b, m = anchors.shape
    masks = parallel - 1
    first = n + torch.arange(m, device=anchors.device)[:, None] * masks + torch.arange(masks, device=anchors.device)
    index = torch.cat([anchors[:, :, None], first.expand(b, -1, -1)], dim=2)  # [b, m, k]
    return gather_positions(hidden, index.flatten(1)).view(b, m, parallel, -1)


@torch.no_grad()
def rank_accuracy(target, model, windows: torch.Tensor, *, parallel: int, mask_token_id: int,
                  depth: int | None = None, top_k: int = 10, batch_size: int = 4, sampling: Sampling = GREEDY,
                  first_root: int = 0, anchors_per_pass: int = 64) -> list[list[float]]:
    """acc[d][r] (heads/training/accuracy.py) of a PARD model, teacher forced on held-out ``windows`` [n, S]: a
    pass anchored at every root from ``first_root`` on whose depth d + 1 lies in the window; ``depth``: at most
    ``parallel`` (None: that)."""
    depth = parallel if depth is None else min(int(depth), parallel)
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    head = model.get_output_embeddings()
    for batch in windows.split(batch_size):
        batch = batch.to(model.device)
        _, target_logits = target_states(target, batch, (-1,))  # [b, S, V]
        s = batch.shape[1]
        roots = torch.arange(first_root, s - 1, device=batch.device)
        for chunk in roots.split(anchors_per_pass):
            chosen = chunk[None].expand(batch.shape[0], -1)
            out = anchor_outputs(anchored_hidden(model, batch, chosen, parallel, mask_token_id), chosen, s, parallel)
            counter.add_blocks(head(out[:, :, :depth]).topk(top_k, dim=-1).indices, chunk, target_logits)
    model.train(was_training)
    return counter.table()

"""Packed batches as a drafter's objective reads them: several conversations back to back in one row
(train/training/packing.py builds them), told apart by their ``position_ids`` [b, S], which restart at 0 with each
conversation (right padding continues the last one's). What a loss needs to keep attention and prediction inside
each conversation, so that a packed row trains exactly what its conversations one by one would:

    positions = packed_positions(batch, device)      # [b, S] or None (a batch that is not packed)
    segments = segment_ids(positions)                # [b, S]: which conversation each token belongs to
    keep &= same_segment(segments, 0, k, width)      # a prediction from position j of token j + k stays inside
    PackedModel(target, positions).base_model(...)   # a transformers model, block-diagonal causal attention
    segment_causal_mask(segments[:, :n], dtype)      # the same as an additive mask, for a drafter's own layers

**Why position ids, not a 4-D mask, for transformers models.** transformers (5.x, ``masking_utils``) reads per-
document position ids as packed sequences when no attention mask and no cache are given, and builds the block-
diagonal causal mask itself from its mask functions, so a sliding-window layer keeps its window (a custom 4-D mask
would replace it); tests/train/training/test_packing.py checks sdpa and eager. ``PackedModel`` therefore passes
``use_cache=False``: with a cache the detection is off and attention would cross conversations. The drafting job
checks once that the target honours it (train/training/packing.py's ``check_packing``). The EAGLE drafters' own
layers run with a cache (the training-time unroll) and an explicit additive mask (heads/training/unroll.py takes
``segments``).
"""

from __future__ import annotations

import torch

from treespec.visibility import relation_mask


def packed_positions(batch, device=None) -> torch.Tensor | None:
    """A packed batch's per-conversation position ids [b, S] (on ``device``), or None: a tensor batch, or a dict
    batch of one conversation per row."""
    if torch.is_tensor(batch) or "position_ids" not in batch:
        return None
    positions = batch["position_ids"]
    return positions.to(device) if device is not None else positions


def segment_ids(positions: torch.Tensor) -> torch.Tensor:
    """[b, S] position ids → [b, S] segment ids, counting from 0 in each row: a new segment wherever a position does
    not follow its predecessor by one (transformers' ``find_packed_sequence_indices`` rule)."""
    first = positions[:, :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).long().cumsum(-1)


def same_segment(segments: torch.Tensor, a: int, b: int, width: int) -> torch.Tensor:
    """[b, S] segment ids → [b, width] bool: entry j is True when positions j + a and j + b both lie in the row
    and in one segment (a prediction made at j + a of the token at j + b stays inside its conversation)."""
    rows, s = segments.shape
    j = torch.arange(width, device=segments.device)
    ok = (j + a >= 0) & (j + a < s) & (j + b >= 0) & (j + b < s)  # [width]
    ia, ib = (j + a).clamp(0, s - 1), (j + b).clamp(0, s - 1)
    return (segments[:, ia] == segments[:, ib]) & ok[None]


def segment_causal(segments: torch.Tensor) -> torch.Tensor:
    """[b, n] segment ids → bool [b, n, n]: query q sees key k <= q of its own segment."""
    n = segments.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=segments.device).tril()
    return causal[None] & (segments[:, :, None] == segments[:, None, :])


def segment_causal_mask(segments: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """[b, n] segment ids → float additive mask [b, 1, n, n] (masks/dense.py: float, never bool, for eager)."""
    return relation_mask(segment_causal(segments), dtype=dtype)


class PackedModel:
    """A transformers causal LM (or its base model's caller) answering ``base_model(...)`` on a packed batch: the
    batch's position ids (a prefix of them, as long as the input) go with every call, with ``use_cache=False`` so
    that transformers builds the block-diagonal causal mask (module docstring). Everything else is the model's."""

    def __init__(self, model, positions: torch.Tensor):
        self._model, self._positions = model, positions

    def __getattr__(self, name):
        return getattr(self._model, name)

    def positions(self, n: int, device) -> torch.Tensor:
        return self._positions[:, :n].to(device)

    def base_model(self, input_ids=None, inputs_embeds=None, **kwargs):
        x = input_ids if input_ids is not None else inputs_embeds
        return self._model.base_model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False,
                                      position_ids=self.positions(x.shape[1], x.device), **kwargs)

    def __call__(self, input_ids=None, **kwargs):
        return self._model(input_ids=input_ids, use_cache=False,
                           position_ids=self.positions(input_ids.shape[1], input_ids.device), **kwargs)


def packed_segments(batch, device=None) -> torch.Tensor | None:
    """``segment_ids`` of a packed batch's position ids [b, S] (on ``device``), or None for any other batch."""
    positions = packed_positions(batch, device)
    return None if positions is None else segment_ids(positions)

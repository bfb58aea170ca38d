"""The EAGLE drafters unrolled over whole windows: sequential drafting from every root of a window at once
(EAGLE-3's training-time test, Li et al. 2025).

A window ``input_ids`` [b, S] gives n = S − 1 committed entries (entry j pairs token j + 1 with the
target's feature at j, at position j). Unrolled step 0 is the causal pass over them: its output at entry r
is draft depth 1 from root r. Step i >= 1 feeds, for every root r, the window's next token (r + 1 + i, at
position r + i) with the root's step i − 1 output, and lets it attend to step-0 keys t <= r (the committed
context) and to root r's own keys of steps 1..i (``unroll_mask``): exactly what drafting depth i + 1 from
root r sees, one pass for all roots (tests/heads/eagle/test_eagle.py and tests/heads/eagle3/test_eagle3.py check it
against drafting one node at a time).

Training (treespec.heads.eagle.objective, treespec.heads.eagle3.objective) takes its losses from it; rank accuracy
(heads/eagle/drafter.py, heads/eagle3/drafter.py) scores its top-k ranks against the target. It lives beside the models,
not with the training jobs, because heads/ never imports treespec.train.

Two layouts, bit for bit what each recipe was written with: EAGLE-3 indexes step i by root (``by_root``:
n − i entries, the window's tail falls off), EAGLE-1 keeps the window's n entries at every step (entry j
drafted from root j − i; entries j < i have no root and are fed zeros, to be masked out by the caller).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from treespec.heads.training import unrolled_attention
from treespec.heads.training.segments import segment_causal_mask, segment_ids
from treespec.heads.training.unrolled_attention import UnrollMask
from treespec.visibility import dense_mask, relation_mask


def unroll_mask(n: int, step: int, *, by_root: bool, dtype=torch.float32, device=None,
                segments: torch.Tensor | None = None, context_only: bool = False) -> torch.Tensor:
    """Float additive mask for unrolled ``step`` >= 1 over the keys of steps 0..step in cache order:
    [1, 1, n − step, Σ_{m<=step} (n − m)] ``by_root``, else [1, 1, n, (step + 1)·n]. A query drafted from
    root r sees step-0 keys t <= r and, of each step m in 1..step, root r's key only (its own chain, itself
    last): the ancestor relation of the chain drafted from r. With a packed batch's ``segments`` [b, n] (the
    conversation of each entry, heads/training/segments.py) the step-0 keys are also those of root r's conversation
    only,
    and the mask is [b, 1, ., .]. ``context_only``: the step-0 columns alone, [., 1, q, n] (heads/training/
    unrolled_attention.py adds each query's chain itself)."""

    def roots(m: int) -> torch.Tensor:  # [entries of step m]: the root each one is drafted from
        return torch.arange(n - m, device=device) if by_root else torch.arange(n, device=device) - m

    root = roots(step)[:, None]  # [q, 1]
    blocks = [torch.arange(n, device=device)[None] <= root]  # [q, n]: the committed context, causal
    if not context_only:
        blocks += [roots(m)[None] == root for m in range(1, step + 1)]  # [q, entries of step m]: its own chain
    if segments is None:
        return dense_mask(torch.cat(blocks, dim=1), 0, dtype=dtype, device=device)
    # a root before the window (EAGLE-1's first entries) sees no step-0 key: its conversation does not matter
    own = segments[:, root[:, 0].clamp(min=0)]  # [b, q]: the conversation of each query's root
    context = blocks[0][None] & (segments[:, None, :] == own[:, :, None])  # [b, q, n]
    b = segments.shape[0]
    seen = torch.cat([context, *(blk[None].expand(b, -1, -1) for blk in blocks[1:])], dim=2)  # [b, q, k]
    return relation_mask(seen, dtype=dtype)


def unrolled(model, input_ids: torch.Tensor, features: torch.Tensor, steps: int, *, by_root: bool,
             positions: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """``model`` (an EagleModel or Eagle3Model) unrolled ``steps`` times over windows ``input_ids`` [b, S] with
    its input features ``features`` [b, n, h] (the target's, fused) at entries 0..n−1. Yields (i, out_i)
    for i = 0..steps, lazily (a caller may stop early): the model's outputs at draft depth i + 1, whose
    logits predict token r + 2 + i for root r. ``by_root``: out_i [b, n − i, h], entry r = root r; else
    out_i [b, n, h], entry j = root j − i (module docstring). ``positions`` [b, S]: a packed batch's position ids
    (heads/training/segments.py): entry j sits at its conversation's position j and attends inside it only."""
    n = input_ids.shape[1] - 1
    steps = max(0, min(steps, n - 1))
    # steps >= 1 as one causal pass each rather than (i + 1) (heads/training/unrolled_attention.py), where it applies
    fast = by_root and unrolled_attention.applies(model.layer_config, features.device)
    cache = DynamicCache(config=model.layer_config) if steps else None
    segments, local = None, None
    if positions is None:
        out = model(input_ids[:, 1:], features, cache=cache)  # [b, n, h], causal
    else:
        segments, local = segment_ids(positions)[:, :n], positions[:, :n]  # [b, n]: entry j's conversation, position
        out = model(input_ids[:, 1:], features, cache=cache, position_ids=local,
                    attention_mask=segment_causal_mask(segments, dtype=features.dtype))  # [b, n, h], causal inside
    yield 0, out
    for i in range(1, steps + 1):
        if by_root:  # root r: token r + 1 + i at position r + i, fed its own step i − 1 output
            tokens, own = input_ids[:, 1 + i :], out[:, : n - i]  # [b, n − i], [b, n − i, h]
            at = torch.arange(i, n, device=out.device)[None] if local is None else local[:, : n - i] + i
        else:  # entry j: token j + 1 at position j, fed step i − 1's output at entry j − 1
            tokens, own = input_ids[:, 1:], torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
            at = torch.arange(n, device=out.device)[None] if local is None else local
        mask = unroll_mask(n, i, by_root=by_root, dtype=out.dtype, device=out.device, segments=segments,
                           context_only=fast)
        with unrolled_attention.selected(model.layer_config) if fast else contextlib.nullcontext():
            out = model(tokens, own, attention_mask=UnrollMask(mask, n, i) if fast else mask, position_ids=at,
                        cache=cache)
        yield i, out

"""The tree attention relation: which keys each new token may attend to.

One target pass verifies every branch of a token tree (SpecInfer, Miao et al. 2024; Medusa, Cai et al.
2024): the N tree tokens (root + candidates) are appended after the cached ones, and each may attend to the
whole past, itself and its ancestors only, so its logits equal those of decoding its root-to-node path one
token at a time. Its position is past_len + depth, the position it would have in that sequential decode.

Sliding-window layers (Mistral, Gemma-2/3, gpt-oss, ...) see less: a query at position p sees only keys at
positions > p − window (transformers' rule, ``masking_utils.sliding_window_overlay``), counted by
*sequential* positions, so a tree node at past_len + depth sees its ancestors and the last
window − 1 − depth cached tokens, exactly what it would see in a sequential decode of its path. Such a
layer's cache may also have dropped its oldest entries: ``start`` is the position of the first cached key,
and the relation has past_len − start cached columns.

masks/ is a leaf: it takes plain tensors (an ancestor matrix, positions, lengths) and imports nothing of
treespec; the core (treespec/visibility.py) turns a Tree and a cache into those tensors.

Axis letters in shape comments: q query tokens (N for a whole tree), t new key positions (the new tokens'
keys), p cached positions (past_len − start), k = p + t all key positions.
"""

from __future__ import annotations

import torch


def visible(allowed: torch.Tensor, past_len: int, *, start: int = 0, window: int | None = None,
            positions: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """BoolTensor [q, (past_len − start) + t]: which keys each query may attend to.

    Keys are the cached positions ``start .. past_len − 1`` (a layer that dropped older entries holds none
    before ``start``), then the t new tokens, of which ``allowed`` [q, t] says which each query sees (itself,
    its ancestors: a tree's ancestor matrix when q = t = N); the queries are the last q new tokens. With
    ``window`` (a sliding-window layer) a query sees only keys at positions > its own − window;
    ``positions`` [t] are the new tokens' positions (default past_len, past_len + 1, ...: a causal
    continuation; past_len + depth for a tree).
    """
    allowed = allowed.to(device=device, dtype=torch.bool)  # [q, t]
    q, t = allowed.shape
    cached = torch.ones(q, past_len - start, dtype=torch.bool, device=allowed.device)  # [q, p]
    seen = torch.cat([cached, allowed], dim=1)  # [q, k]
    if window is None:
        return seen
    if positions is None:
        positions = past_len + torch.arange(t)
    positions = positions.to(allowed.device)
    keys = torch.cat([torch.arange(start, past_len, device=allowed.device), positions])  # [k]
    queries = positions[t - q :]  # [q]
    return seen & (keys[None, :] > queries[:, None] - window)


def visible_rows(cached: torch.Tensor | None, allowed: torch.Tensor, past_len: int, *, device=None) -> torch.Tensor:
    """BoolTensor [b, q, past_len + t]: ``visible`` for a batch whose rows share one cache slot axis but not
    every slot (treespec/cache.py: left padding and the holes ragged acceptance leaves are invalid slots of
    a row). ``cached`` [b, past_len]: which cached slots hold a token of the row (None: all of them);
    ``allowed`` [b or 1, q, t]: each row's relation among the new tokens (a shared tree broadcasts). Full
    attention only: a sliding window counts positions, which differ between rows here."""
    allowed = allowed.to(device=device, dtype=torch.bool)
    if allowed.dim() == 2:
        allowed = allowed[None]
    if cached is None:
        b = allowed.shape[0]
        cached = torch.ones(b, past_len, dtype=torch.bool, device=allowed.device)
    cached = cached.to(allowed.device)
    b, q = max(cached.shape[0], allowed.shape[0]), allowed.shape[1]
    return torch.cat([cached[:, None, :past_len].expand(b, q, past_len), allowed.expand(b, q, -1)], dim=-1)

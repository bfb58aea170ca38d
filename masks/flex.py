"""Tree attention as a FlexAttention ``BlockMask``, for ``attn_implementation="flex_attention"``.

The same relation as ``masks.relation.visible``, expressed as a ``mask_mod`` so FlexAttention (PyTorch
2.5+) can skip fully-masked blocks on GPU, where flash_attention_2 cannot take a tree mask at all. The
float mask of ``masks.dense`` stays the portable default (eager / sdpa, CPU); use this one with flex on GPU.

Axis letters: q query (tree) tokens = N, k key positions = past_len − start + N.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


def mask_mod_of(allowed: torch.Tensor):
    """The FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of a bool relation ``allowed`` [q, k]
    (``visible``), or [b, q, k] per row of a batch (``visible_rows``): a bare lookup in the dense table,
    with no index arithmetic.

    Why: with torch 2.13, mask_mods that combine a gather with arithmetic on the indices ("kv < past_len
    or ancestors[q, kv - past_len]", pre-order interval tests, even clamping the indices) hit an inductor
    C++ codegen error (CppCompileError) when transformers compiled flex_attention on CPU; the bare
    lookup compiles and matches sdpa.
    """

    if allowed.dim() == 3:
        def batch_mask_mod(b, h, q_idx, kv_idx):
            return allowed[b, q_idx, kv_idx]

        return batch_mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        # No clamping needed: flex's GPU kernels bound padded indices themselves (get_bounded_indices).
        return allowed[q_idx, kv_idx]

    return mask_mod


def block_mask(allowed: torch.Tensor, device=None) -> BlockMask:
    """A ``BlockMask`` of a bool relation ``allowed`` [q, k] (batch and heads broadcast) or [b, q, k] (one per
    row of a batch, heads broadcast).

    ``create_block_mask`` evaluates the mask_mod over every (query, key) pair (about a second on a CPU):
    a decoding run builds its masks with ``FlexTreeMasks`` instead."""
    device = allowed.device if device is None else torch.device(device)
    *batch, q, k = allowed.shape
    return create_block_mask(mask_mod_of(allowed.to(device)), B=batch[0] if batch else None, H=None, Q_LEN=q,
                             KV_LEN=k, device=device)


class FlexTreeMasks:
    """The block masks of one decoding run's steps, on full-attention layers (start 0, no window), without
    ``create_block_mask`` per step (the dominant per-step cost of a flex tree pass on a GPU).

    Two things are kept across steps. The relation lives in one bool table ``allowed`` [N, capacity]: columns
    before past_len True, the tree's block at past_len .. past_len + N − 1, False after; a step rewrites only
    the last step's block and this one's, and the mask_mod is the same bare lookup into a tensor of a fixed
    shape (``mask_mod_of``), so a compiled flex kernel sees the same mask_mod until the table doubles. The
    block structure is arithmetic: key blocks wholly before past_len are full (every query sees them), the
    rest up to past_len + N are partial, and ``BlockMask.from_kv_blocks`` takes those counts directly.
    """

    def __init__(self, *, device=None, block_size: int = 128):
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.block_size = block_size
        self._source: torch.Tensor | None = None  # the ancestor matrix the kept table was built from
        self._ancestors = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [N, N], on the device
        self._past = 0  # where the table's tree block starts
        self._allowed = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [N, capacity]
        self._mask_mod = None

    def __call__(self, ancestors: torch.Tensor, past_len: int) -> BlockMask:
        """ancestors: BoolTensor [N, N] → the BlockMask over q = N tree tokens and k = past_len + N keys."""
        n = ancestors.shape[0]
        length = past_len + n
        if ancestors is not self._source or self._allowed.shape[1] < length:
            self._source, self._ancestors = ancestors, ancestors.to(self.device)
            capacity = max(self._allowed.shape[1], 2 * length, self.block_size)
            self._allowed = torch.zeros(n, capacity, dtype=torch.bool, device=self.device)
            self._allowed[:, :past_len] = True
            self._mask_mod = mask_mod_of(self._allowed)
        else:  # the last step's tree columns are past now (or beyond the new tree's end)
            self._allowed[:, self._past : self._past + n] = False
            self._allowed[:, self._past : past_len] = True
        self._allowed[:, past_len:length] = self._ancestors
        self._past = past_len
        return BlockMask.from_kv_blocks(*self._kv_blocks(n, past_len, length), BLOCK_SIZE=self.block_size,
                                        mask_mod=self._mask_mod, seq_lengths=(n, length), compute_q_blocks=False)

    def _kv_blocks(self, n: int, past_len: int, length: int):
        """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), each [b=1, h=1, q_blocks(, k_blocks)]."""
        q_blocks = -(-n // self.block_size)
        k_blocks = -(-length // self.block_size)
        full = past_len // self.block_size  # key blocks wholly in the past
        order = torch.arange(k_blocks, dtype=torch.int32, device=self.device)
        partial = torch.cat([order[full:], order[:full]])  # the partial blocks first, then anything
        counts = [(k_blocks - full, partial), (full, order)]
        # every query block of the one broadcast (batch, head) visits the same key blocks
        return [t for count, indices in counts for t in (
            torch.full((1, 1, q_blocks), count, dtype=torch.int32, device=self.device),
            repeat(indices, "k -> 1 1 q k", q=q_blocks).contiguous())]

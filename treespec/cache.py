"""The KV cache of tree passes: which entries each layer keeps (the masks that address them: treespec/visibility.py).

**Keeping the accepted path.** A verification pass appends all N tree tokens to the cache, but only the
root and the accepted path belong to the sequence. ``keep_tree_path`` compacts them down to contiguous
positions and drops the rest, leaving the cache exactly as if the accepted tokens had been decoded one by
one, so the next step is an ordinary continuation (transformers 5.x DynamicCache: per layer ``.keys/.values``
of shape [b, kv_heads, seq, head_dim]).

**Sliding-window layers** (Mistral, Phi-3, Qwen2 with ``use_sliding_window``, and interleaved with full
layers in Gemma-2/3 and gpt-oss). transformers' ``DynamicSlidingWindowLayer`` keeps only the last
window − 1 entries after every update, so a tree pass of N tokens pushes committed tokens that are still
inside the next step's window out of the cache before the walker knows which nodes survive, and rolling
back to the accepted path is impossible. (Its ``record_past`` mode keeps them, but hands each pass only the
last window − 1 + q keys, which drops committed keys that a drafter's second expansion pass still needs.)
So ``TreeCache`` gives each sliding layer a ``SlidingWindowLayer`` instead: it keeps every entry a pass
appends, as a full-attention layer does, and only ``keep_tree_path`` — the one place that knows which
entries are committed — drops what no later query can see: all but the last window − 1 committed entries
(the next root, at position L, sees positions > L − window). Memory stays bounded by the window (window − 1
+ the tokens fed since the last compaction), which matters for Gemma-3 (five of six layers slide over
1,024 tokens of a 128k context); keeping sliding layers as full layers and masking would be as correct and
a little simpler, but would grow them with the whole sequence.

A sliding layer's first entry is then at position ``start`` (> 0 once it dropped entries), and the window
is applied by sequential position, so it needs its own tree mask: ``visibility.attention_masks`` builds one
per kind of layer, a single mask when all layers are alike (Mistral takes one mask for every
layer), and a dict keyed by layer type when they differ (the form transformers 5.x models with
``config.layer_types`` take, e.g. Gemma-2). For a chain and the prefill, the model builds its own masks
from ``get_mask_sizes`` (keys held, offset = start), as it does for transformers' own sliding layers.

**A batch of rows** (treespec/rows.py). Every row of a batch lives on ONE physical slot axis: every pass
appends the same number of slots to every row, so each layer stays one [b, kv_heads, seq, head_dim] tensor
that a model attends over in one call. What differs between rows is which slots hold their tokens: a
``RowSlots`` keeps a validity mask [b, seq] beside the cache, and a row's invalid slots are

- its left padding (transformers' convention for a batch of prompts of different lengths), and
- the holes ragged acceptance leaves: after a tree pass of N tokens at slots S .. S + N − 1, row b keeps its
  root and its k_b accepted nodes compacted to S .. S + k_b (``keep_row_paths``: one gather per layer with an
  index [b, 1 + k_max]; none for chains, whose accepted nodes are already in place), the physical length
  becomes S + 1 + max_b k_b, and the slots S + 1 + k_b .. S + k_max of a row that accepted fewer are holes.

Between steps a row's cache therefore holds every committed token but its root, in order, interleaved with
invalid slots. A row's position ids count its valid slots (its logical position), so its keys carry exactly
the positions a sequential decode of that row alone gives them, and the mask of a pass over N new tokens
per row is [b, 1, N, S + N]: the row's validity over the cached slots, then the tree's ancestor relation
(one per row for per-row trees). A batch without an invalid slot (one row, or rows of one length that
accepted alike) keeps the single-sequence path: the model's own causal mask for chains, one broadcast mask
for trees. Sliding-window layers count positions by slot, so they take one row only (refused at the door
for a batch). Finished rows leave the batch (``select_rows``: an index_select on the batch dimension of
every layer), so they stop costing compute; the slots stay as long as the longest row needs them.

**Layer types** (full, sliding, recurrent) and the models whose state cannot be rolled back are the business of
treespec/layer_types.py: a ``TreeCache`` holds full-attention and sliding-window layers, a hybrid target keeps
transformers' own ``DynamicCache`` (``decoding_cache``) and is verified by treespec/recurrent.py.
"""

from __future__ import annotations

import torch
from einops import rearrange
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from treespec.compat import empty_layer
from treespec.layer_types import attention_layers, is_hybrid


class PreallocatedLayer(DynamicLayer):
    """A full-attention layer that writes new entries into a preallocated buffer instead of concatenating.

    transformers' ``DynamicLayer`` copies its whole cache on every update (``torch.cat``), a cost that grows
    with the sequence and is a large share of a one-token forward on a CPU.
    Here ``keys``/``values`` stay views of exactly the held entries (``buffer[:, :, :held]``), so whatever reads or
    slices them as a DynamicLayer's (masks, ``keep_tree_path``, ``crop``) works unchanged; the buffer doubles
    when full, and a layer whose keys were replaced by something else (batch ops) is copied into a new one."""

    MIN_CAPACITY = 256

    def __init__(self):
        super().__init__()
        # keys [b, h, capacity, d] and values [b, h, capacity, d_v]: views of one [2, b, h, capacity, d] buffer
        # (``_kv``) when their shapes agree, so that a tree pass's compaction moves both in one gather
        self._kv: torch.Tensor | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _holds_prefix(self) -> bool:
        """Whether ``keys``/``values`` are still prefix views of the buffers (``update`` may write after them)."""
        if self._buffers is None or self.keys.dim() != 4:
            return False
        return all(t.data_ptr() == buf.data_ptr() and t.shape[:2] == buf.shape[:2] and t.stride() == buf.stride()
                   for t, buf in zip((self.keys, self.values), self._buffers, strict=True))

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor,
                 capacity: int | None = None) -> None:
        """Room for ``needed`` entries: new buffers of twice ``needed`` when the held ones are too small, or (a
        static pass) of exactly ``capacity`` unless they have that size. Zeros, not uninitialised memory: a static
        pass (treespec/static_pass.py) attends over the whole buffer with the unheld slots masked, and a masked NaN
        would still poison it (0 · NaN)."""
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        size = self._buffers[0].shape[-2] if self._holds_prefix() else None
        if size is not None and (size >= needed if capacity is None else size == max(capacity, needed)):
            return
        capacity = max(self.MIN_CAPACITY, 2 * needed) if capacity is None else max(capacity, needed)
        k_shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
        v_shape = (*value_states.shape[:2], capacity, value_states.shape[-1])
        if k_shape == v_shape and key_states.dtype == value_states.dtype:
            self._kv = key_states.new_zeros(2, *k_shape)
            buffers = (self._kv[0], self._kv[1])
        else:  # e.g. a value head size of its own
            self._kv = None
            buffers = (key_states.new_zeros(k_shape), value_states.new_zeros(v_shape))
        if held:
            buffers[0][:, :, :held] = self.keys
            buffers[1][:, :, :held] = self.values
        self._buffers = buffers
        self.keys, self.values = buffers[0][:, :, :held], buffers[1][:, :, :held]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = held + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        keys, values = self._buffers
        keys[:, :, held:end] = key_states
        values[:, :, held:end] = value_states
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def static_buffers(self, capacity: int) -> tuple[torch.Tensor, ...]:
        """What a static pass writes into, of ``capacity`` entries (S; at least those held): ``(kv,)`` [2, b, h, S, d]
        when keys and values share one buffer, else (keys [b, h, S, d], values [b, h, S, d_v]); held entries first."""
        self._reserve(capacity, self.keys, self.values, capacity=capacity)
        return (self._kv,) if self._kv is not None else self._buffers

    def hold(self, end: int) -> None:
        """The first ``end`` buffered entries are the held ones (a static pass wrote up to them)."""
        self.keys, self.values = self._buffers[0][:, :, :end], self._buffers[1][:, :, :end]

    def move_rows(self, root: int, src: torch.Tensor) -> bool:
        """Write the entries at rows ``src`` [k] to rows root .. root + k − 1, keys and values in one gather;
        False (nothing done) when they are not views of one buffer, for the caller to move them one by one."""
        if self._kv is None or not self._holds_prefix():
            return False
        self._kv[:, :, :, root : root + src.numel()] = self._kv.index_select(3, src)
        return True

    def gather_rows(self, start: int, index: torch.Tensor) -> bool:
        """Row b writes its entries at start + index[b] [k] to start .. start + k − 1, keys and values in one
        gather; False (nothing done) when they are not views of one buffer, for the caller to move them."""
        if self._kv is None or not self._holds_prefix():
            return False
        two, b, h, _, d = self._kv.shape
        where = rearrange(start + index, "b k -> 1 b 1 k 1").expand(two, b, h, -1, d)
        self._kv[:, :, :, start : start + index.shape[1]] = self._kv.gather(3, where)
        return True

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` [b'] (in that order), in new buffers."""
        held = self.keys.shape[-2]
        if self._holds_prefix() and self._kv is not None:
            self._kv = self._kv.index_select(1, rows)
            self._buffers = (self._kv[0], self._kv[1])
        elif self._holds_prefix():
            self._buffers = tuple(buf.index_select(0, rows) for buf in self._buffers)
        else:
            self._kv = self._buffers = None
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
            return
        self.keys, self.values = self._buffers[0][:, :, :held], self._buffers[1][:, :, :held]

    def reset(self) -> None:
        super().reset()
        empty_layer(self)
        self._kv = self._buffers = None


class SlidingWindowLayer(DynamicLayer):
    """A sliding-window layer whose entries can be rolled back: it keeps every entry a pass appends (as
    ``DynamicLayer``), and ``keep_tree_path`` drops the committed entries older than the window. ``start``
    is the position of its first entry; lengths and mask offsets count from position 0, as transformers'
    ``DynamicSlidingWindowLayer`` reports them."""

    is_sliding = True

    def __init__(self, sliding_window: int):
        super().__init__()
        self.sliding_window = sliding_window
        self.start = 0

    def held(self) -> int:
        """Entries held (positions start .. start + held − 1)."""
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.start + self.held()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held() + query_length, self.start  # (kv_length, kv_offset)

    def reset(self) -> None:
        super().reset()
        empty_layer(self)
        self.start = 0


class TreeCache(DynamicCache):
    """transformers' DynamicCache for a model with ``config``, every layer of which ``keep_tree_path`` can roll
    back: full layers as ``PreallocatedLayer`` (``preallocate=False``: transformers' DynamicLayer), sliding
    layers as ``SlidingWindowLayer``. Remembers the layer types (``config.layer_types``) to key one mask per
    type by."""

    def __init__(self, config, *, preallocate: bool = True):
        windows = attention_layers(config)
        super().__init__(config=config)
        full = PreallocatedLayer if preallocate else DynamicLayer
        self.layers = [full() if w is None else SlidingWindowLayer(w) for w in windows]
        self.layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)


def decoding_cache(config):
    """The cache a model of ``config`` decodes tree passes over: a ``TreeCache``, or for a hybrid transformers' own
    ``DynamicCache``, whose recurrent layers treespec/recurrent.py rolls back."""
    return DynamicCache(config=config) if is_hybrid(config) else TreeCache(config)


def check_layer(layer) -> None:
    """Raise NotImplementedError unless ``keep_tree_path`` can roll ``layer`` back. (The one refusal kept here, beside
    the layer classes it names: treespec/layer_types.py refuses a model's layer types and cannot import them.)"""
    if type(layer) in (DynamicLayer, PreallocatedLayer, SlidingWindowLayer):
        return
    why = "; treespec supports DynamicLayer, PreallocatedLayer and SlidingWindowLayer caches"
    if type(layer).__name__ == "DynamicSlidingWindowLayer":
        why = (" (it keeps only the last sliding_window - 1 tokens, so a tree pass pushes committed tokens out): build "
               "the cache with treespec.cache.TreeCache(config)")
    raise NotImplementedError(f"cache layer type {type(layer).__name__} cannot be rolled back to an accepted tree path"
                              + why)


def keep_tree_path(cache, past_len: int, keep) -> None:
    """Keep the cache entries at positions ``past_len + keep`` (tree-node offsets, increasing, root = 0) and drop
    everything after them, in place; sliding layers then drop the entries older than their window.
    keep: a list of ints or a LongTensor [k]."""
    keep = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
    k = len(keep)
    contiguous = keep == list(range(k))  # a chain prefix (the common case) is already in place
    sources: dict[tuple[torch.device, int], torch.Tensor] = {}  # rows to gather, once per device and root
    for layer in cache.layers:
        check_layer(layer)
        if not layer.is_initialized:
            continue
        start = getattr(layer, "start", 0)
        root = past_len - start  # entry index of tree node 0
        if not contiguous:
            where = (layer.keys.device, root)
            if where not in sources:
                sources[where] = torch.tensor([root + i for i in keep], dtype=torch.long, device=where[0])
            src = sources[where]
            # [b, h, seq, d]: gather the accepted rows, then write them right after the prefix
            if not (isinstance(layer, PreallocatedLayer) and layer.move_rows(root, src)):
                layer.keys[:, :, root : root + k] = layer.keys.index_select(2, src)
                layer.values[:, :, root : root + k] = layer.values.index_select(2, src)
        end = root + k
        drop = max(0, end - (layer.sliding_window - 1)) if isinstance(layer, SlidingWindowLayer) else 0
        if not drop and layer.keys.shape[2] == end:  # nothing to drop (plain decoding keeps what it fed)
            continue
        layer.keys = layer.keys[:, :, drop:end]
        layer.values = layer.values[:, :, drop:end]
        if drop:
            layer.start = start + drop


def keep_row_paths(cache, past_len: int, keeps: list[list[int]]) -> int:
    """``keep_tree_path`` per row of a batch: row b keeps its entries at ``past_len + keeps[b]`` (increasing
    tree-node offsets) compacted to past_len .., and every layer is cut to past_len + max_b len(keeps[b]), the
    tail of a shorter row being holes its ``RowSlots`` marks invalid. Rows that keep alike take
    ``keep_tree_path``; rows that keep chain prefixes move nothing; else one gather per layer. Returns the
    slots kept (max_b len(keeps[b])). Full-attention layers only (a batch refuses sliding ones)."""
    if all(keep == keeps[0] for keep in keeps[1:]):
        keep_tree_path(cache, past_len, keeps[0])
        return len(keeps[0])
    width = max(len(keep) for keep in keeps)
    if any(keep != list(range(len(keep))) for keep in keeps):
        # a shorter row's tail repeats its last entry (or the slot itself): holes, whatever they hold
        index = torch.tensor([keep + [keep[-1] if keep else 0] * (width - len(keep)) for keep in keeps])  # [b, k]
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, SlidingWindowLayer) or type(layer) not in (DynamicLayer, PreallocatedLayer):
                raise NotImplementedError(f"{type(layer).__name__} cannot keep a different path per row")
            src = on_device.setdefault(layer.keys.device, index.to(layer.keys.device))
            if not (isinstance(layer, PreallocatedLayer) and layer.gather_rows(past_len, src)):
                for name in ("keys", "values"):
                    t = getattr(layer, name)  # [b, h, seq, d]
                    where = rearrange(past_len + src, "b k -> b 1 k 1").expand(-1, t.shape[1], -1, t.shape[3])
                    t[:, :, past_len : past_len + width] = t.gather(2, where)
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[:, :, : past_len + width], layer.values[:, :, : past_len + width]
    return width


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep the batch rows ``rows`` [b'] of every layer (finished rows leave the batch)."""
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if isinstance(layer, PreallocatedLayer):
            layer.select_rows(rows.to(layer.keys.device))
        else:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.keys.device))



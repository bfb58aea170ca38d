"""The KV cache of tree passes: which entries each layer keeps, and the masks that address them.

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
is applied by sequential position, so it needs its own tree mask: ``attention_masks`` builds one per kind
of layer (``masks.mask_for``), a single mask when all layers are alike (Mistral takes one mask for every
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

**Recurrent state** (hybrid targets: linear-attention, state-space and short-convolution layers, by the cache
layer types ``linear_attention``, ``conv`` and ``hybrid``) integrates every token a pass feeds, siblings
included, and has no mask: those targets keep transformers' own ``DynamicCache`` and are verified by
treespec/recurrent.py (root-to-leaf paths as batch rows, a state snapshot, restore and replay), one prompt at
a time.

**What cannot be rolled back** is refused before any forward (``check_rollback``, called at generate's door):
sliding windows inside recurrent layers (``hybrid_sliding``), chunked attention (Llama 4), caches shared
across layers, sparse indexer caches, models without any attention layer, and models transformers marks
stateful whose layer types say nothing recurrent (their state lives outside the cache). ``check_filled``
catches, after the prefill, any other model that keeps its state outside the cache it was given.
"""

from __future__ import annotations

import torch
from einops import rearrange
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from treespec import compat
from treespec.compat import empty_layer, layer_types_and_kwargs
from treespec.masks import mask_for
from treespec.recurrent import RECURRENT_LAYER_TYPES, is_recurrent

# Layer types (treespec.compat.layer_types_and_kwargs) a TreeCache cannot hold, and why; the recurrent ones
# (RECURRENT_LAYER_TYPES) are verified by treespec/recurrent.py instead
UNSUPPORTED_LAYERS = {
    "linear_attention": "recurrent state (linear attention / state-space layers): treespec/recurrent.py verifies it",
    "conv": "convolution state: treespec/recurrent.py verifies it",
    "hybrid": "recurrent state beside attention: treespec/recurrent.py verifies it",
    "hybrid_sliding": "a sliding-window attention layer inside a recurrent one: the path rows of "
                      "treespec/recurrent.py would need windows per row, which treespec does not build yet",
    "chunked_attention": "chunked attention (Llama 4) needs chunk-aligned tree masks, which treespec does not build "
                         "yet",
    "dummy": "layers that reuse another layer's KV cache (KV sharing) are not supported yet",
    "indexed_attention": "sparse attention with an indexer cache (DeepSeek-V3.2 style) is not supported yet",
}


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

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if self._holds_prefix() and self._buffers[0].shape[-2] >= needed:
            return
        capacity = max(self.MIN_CAPACITY, 2 * needed)
        k_shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
        v_shape = (*value_states.shape[:2], capacity, value_states.shape[-1])
        if k_shape == v_shape and key_states.dtype == value_states.dtype:
            self._kv = key_states.new_empty(2, *k_shape)
            buffers = (self._kv[0], self._kv[1])
        else:  # e.g. a value head size of its own
            self._kv = None
            buffers = (key_states.new_empty(k_shape), value_states.new_empty(v_shape))
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


def attention_layers(config) -> list[int | None]:
    """The sliding window of each decoder layer (None: full attention), classified as transformers'
    DynamicCache classifies them. Raises ValueError naming the model and the layer types treespec cannot
    roll back (see UNSUPPORTED_LAYERS), and interleaved windows a single mask cannot express."""
    decoder = config.get_text_config(decoder=True)
    types, kwargs = layer_types_and_kwargs(decoder)
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        reasons = "; ".join(f"{t!r} ({types.count(t)} of {len(types)} layers): "
                            f"{UNSUPPORTED_LAYERS.get(t, 'a cache layer type treespec does not know')}" for t in bad)
        raise ValueError(f"{getattr(config, 'model_type', type(config).__name__)} cannot be verified with tree passes: "
                         f"{reasons}. treespec supports full-attention and sliding-window KV caches")
    windows = [kw.get("sliding_window") if t == "sliding_attention" else None
               for t, kw in zip(types, kwargs, strict=True)]
    if len(set(windows)) > 1 and getattr(decoder, "layer_types", None) is None:
        raise ValueError(f"{config.model_type} mixes attention windows {sorted(set(windows), key=str)} but has no "
                         "config.layer_types to key one mask per layer type by")
    return windows


def is_hybrid(config) -> bool:
    """Whether ``config``'s decoder has recurrent layers (verified by treespec/recurrent.py)."""
    types, _ = layer_types_and_kwargs(config.get_text_config(decoder=True))
    return bool(RECURRENT_LAYER_TYPES & set(types))


def check_hybrid(config, *, drafting: bool = False) -> None:
    """Raise ValueError naming what treespec/recurrent.py cannot verify in a hybrid ``config`` (``drafting``: what
    its ``DraftRows`` cannot draft with: the same, but a model without attention layers is fine, its drafter's row
    slots counting its tokens)."""
    decoder = config.get_text_config(decoder=True)
    types, _ = layer_types_and_kwargs(decoder)
    if compat.release() < compat.HYBRID_MIN_VERSION:
        oldest = ".".join(map(str, compat.HYBRID_MIN_VERSION))
        raise ValueError(f"{config.model_type} has recurrent layers, which treespec verifies with transformers >= "
                         f"{oldest} only (this is {compat.TRANSFORMERS_VERSION}: its hybrid models were not all found "
                         "lossless): upgrade transformers")
    kv_shared = getattr(decoder, "kv_sharing_modes", None) or getattr(decoder, "num_kv_shared_layers", 0)
    allowed = RECURRENT_LAYER_TYPES | {"full_attention"} | (set() if kv_shared else {"dummy"})  # dummy: MLP/MoE
    bad = sorted(set(types) - allowed)
    if bad:
        reasons = "; ".join(f"{t!r} ({types.count(t)} of {len(types)} layers): "
                            f"{UNSUPPORTED_LAYERS.get(t, 'a cache layer type treespec does not know')}" for t in bad)
        raise ValueError(f"{config.model_type} cannot be verified with tree passes: {reasons}")
    if not drafting and not {"full_attention", "hybrid"} & set(types):
        raise ValueError(f"{config.model_type} has no attention layer: treespec verifies recurrent layers only beside "
                         "attention ones (transformers' cache counts the tokens it holds by its attention layers)")


def check_layer_types(config, *, drafting: bool = False) -> str:
    """"hybrid" (recurrent layers, verified by treespec/recurrent.py) or "attention" (a TreeCache holds every
    layer); raises ValueError naming the layer types neither can roll back (``drafting``: in a draft model)."""
    if is_hybrid(config):
        check_hybrid(config, drafting=drafting)
        return "hybrid"
    attention_layers(config)
    return "attention"


def check_rollback(model, *, drafting: bool = False) -> None:
    """Raise ValueError, naming the reason, if tree passes cannot be rolled back in ``model``'s state: cache
    layer types treespec does not handle (``attention_layers``; ``check_hybrid`` for recurrent ones), or a model
    transformers marks stateful whose layer types are all attention (it keeps its state elsewhere, and
    transformers refuses assisted generation for it for the same reason). ``drafting``: as a draft model."""
    if check_layer_types(model.config, drafting=drafting) == "hybrid":
        return
    if getattr(model, "_is_stateful", False):
        raise ValueError(f"{type(model).__name__} keeps a recurrent state (transformers marks it stateful) that every "
                         "token of a tree pass updates, siblings included, and that cannot be rolled back to the "
                         "accepted path")


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


def check_filled(cache, length: int, model) -> None:
    """After a prefill of ``length`` tokens, every layer must hold them: a model that keeps its state elsewhere
    (its own cache class, a recurrent state) would be verified without its past."""
    # recurrent layers and those without a cache (MLP/MoE layers of a hybrid: DummyLayer) count no tokens
    held = {layer.get_seq_length() if layer.is_initialized else 0 for layer in cache.layers
            if isinstance(layer, DynamicLayer) or not (is_recurrent(layer) or getattr(layer, "keys", 0) is None)}
    if held != {length}:
        raise ValueError(f"{type(model).__name__} did not fill the KV cache it was given (a prefill of {length} tokens "
                         f"left layers holding {sorted(held)}): it keeps its state elsewhere, which treespec cannot "
                         "roll back")


def check_layer(layer) -> None:
    """Raise NotImplementedError unless ``keep_tree_path`` can roll ``layer`` back."""
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


def attention_masks(cache, allowed: torch.Tensor, past_len: int, positions: torch.Tensor, *,
                    attn_implementation: str = "sdpa", dtype=torch.float32, device=None):
    """The ``attention_mask`` a forward over new tokens takes, given what each layer of ``cache`` holds.

    ``allowed`` [q, t]: which new tokens each query sees (itself, its ancestors), the queries being the last
    q of them; ``positions`` [t]: the new tokens' sequential positions; the cache holds positions up to
    ``past_len − 1``. One mask (``masks.mask_for``) per kind of layer: a single mask when every layer is
    alike, else a dict keyed by layer type (a ``TreeCache`` knows its model's ``config.layer_types``).
    """
    for layer in cache.layers:
        check_layer(layer)
    # (window, first cached position) of each layer; a cache whose layers are created lazily has none before
    # its first forward
    kinds = [(getattr(layer, "sliding_window", None), getattr(layer, "start", 0)) for layer in cache.layers]
    masks = {kind: mask_for(attn_implementation, allowed, past_len, positions=positions, start=kind[1], window=kind[0],
                            dtype=dtype, device=device) for kind in dict.fromkeys(kinds or [(None, 0)])}
    if len(masks) == 1:
        return next(iter(masks.values()))
    by_type = {}
    for layer_type, kind in zip(cache.layer_types, kinds, strict=True):
        if by_type.setdefault(layer_type, kind) != kind:  # one mask per type must fit every layer of that type
            raise RuntimeError(f"{layer_type!r} layers hold different windows or positions: {by_type[layer_type]} "
                               f"and {kind} (window, first cached position)")
    return {layer_type: masks[kind] for layer_type, kind in by_type.items()}

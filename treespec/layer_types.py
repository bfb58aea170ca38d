"""A model's layer types (transformers' cache layer types, ``treespec.compat.layer_types_and_kwargs``): which a
``TreeCache`` holds (treespec/cache.py), which treespec/recurrent.py verifies, and the refusals of the rest.

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

from transformers.cache_utils import DynamicLayer

from treespec import compat
from treespec.compat import layer_types_and_kwargs
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


def sliding_window(config) -> int | None:
    """The first sliding window among ``config``'s decoder layers (``attention_layers``), None when every layer
    attends to the whole cache."""
    return next((w for w in attention_layers(config) if w is not None), None)


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



"""The transformers API differences between the releases treespec supports, each found once, here.

treespec runs on transformers 5.8.1 (SpecForge 0.2's pin) through 5.24 (setup.cfg), so that one environment can
hold treespec beside the tools researchers pair it with (vLLM 0.32 pins < 5.20, speculators 0.9 <= 5.19). Every
call site goes through this module instead of testing versions itself; what differs:

- **The KV cache keyword.** 5.24 passes the cache to every model, decoder-layer and attention forward as
  ``cache=`` and returns it as ``out.cache``; 5.23 and older call both ``past_key_values``. A forward given the
  other name swallows it into ``**kwargs`` and runs WITHOUT the cache, silently (plain decoding then fails
  ``check_filled``, and a drafter's tree pass attends to nothing cached). ``cache_arg(cache)`` is the keyword
  argument under this release's name; ``output_cache(out)`` reads it back. Found from the signature of Llama's
  attention forward, the class every supported architecture's layer follows.
- **Cache layer types.** ``transformers.cache_utils.get_layer_types_and_kwargs`` (which cache layer each decoder
  layer gets, and its sliding window) appeared after 5.8; older releases classify inline in
  ``DynamicCache.__init__``; before 5.19 (5.17, a GPU machine's image, seen) the function returns one kwargs dict
  for every layer, from 5.19 one dict per layer. ``layer_types_and_kwargs`` is the library's function where it
  exists, its kwargs made one dict per layer, else the same
  classification written out from 5.8's ``DynamicCache``, with its layer-type names mapped to the newer ones
  (``mamba`` → ``linear_attention``; ``moe`` and KV-shared layers → ``dummy``, layers without a KV cache).
- **Emptying a cache layer.** 5.24's ``DynamicLayer.reset`` drops the layer's tensors (the next update starts it
  afresh); 5.8's zeroes them in place and keeps their length, so the cache would still report the old
  sequence. ``empty_layer`` does what 5.24 does, on every release.
- **Logits of the last position only.** Causal LMs take ``logits_to_keep`` (a prefill then projects one
  position, not the whole prompt, through the lm_head); other models do not: ``prefill_kwargs(model)``.
- **Generating without an end token.** ``generate(..., eos_token_id=None)`` crashes 5.8's prompt-lookup
  candidate generator (``torch.isin(ids, None)``); ``NO_EOS`` (an empty list) means the same on every release.
"""

from __future__ import annotations

import inspect

import transformers
from transformers.models.llama import modeling_llama

try:  # transformers >= 5.9
    from transformers.cache_utils import get_layer_types_and_kwargs as _library_layer_types
except ImportError:  # 5.8: DynamicCache classifies the layers itself
    _library_layer_types = None

TRANSFORMERS_VERSION = transformers.__version__

#: the forward keyword (and output field) that carries the KV cache in this transformers release
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(modeling_llama.LlamaAttention.forward).parameters \
    else "past_key_values"


def cache_arg(cache) -> dict:
    """``{keyword: cache}`` for a transformers forward (model, decoder layer or attention): ``**cache_arg(c)``."""
    return {CACHE_KEYWORD: cache}


def output_cache(out):
    """The cache a model output returns (``out.cache`` in 5.24, ``out.past_key_values`` before)."""
    return getattr(out, CACHE_KEYWORD)


_WINDOWED = ("sliding_attention", "chunked_attention", "hybrid_sliding")
# 5.8 layer-type names → the names get_layer_types_and_kwargs uses (layer_types.UNSUPPORTED_LAYERS is keyed by them)
_RENAMED_LAYER_TYPES = {"mamba": "linear_attention", "moe": "dummy", "mlp": "dummy"}


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """(cache layer type of each decoder layer, the kwargs its cache layer is built with: ``sliding_window`` for
    sliding and chunked layers) of a decoder ``config``, as this release's DynamicCache classifies them."""
    if _library_layer_types is not None:  # before 5.24 it left Nemotron-H's "mlp" and "moe" blocks as they are
        types, kwargs = _library_layer_types(config)
        types = [_RENAMED_LAYER_TYPES.get(t, t) for t in types]
        if isinstance(kwargs, dict):  # before 5.19 (5.17 seen): one dict for all layers; windowed ones take its window
            kwargs = [dict(kwargs) if t in _WINDOWED else {k: v for k, v in kwargs.items() if k != "sliding_window"}
                      for t in types]
        return types, kwargs
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # 5.8: any sliding window (or chunk size) makes every layer a sliding one
        types = ["sliding_attention" if (window or chunk) is not None else "full_attention"] * config.num_hidden_layers
    types = [_RENAMED_LAYER_TYPES.get(t, t) for t in types]
    shared = getattr(config, "num_kv_shared_layers", 0) or 0  # Gemma-3n: the last layers reuse earlier caches
    if shared:
        types = types[:-shared] + ["dummy"] * shared
    kwargs = [{"sliding_window": window or chunk} if t == "sliding_attention" else
              {"sliding_window": chunk or window} if t == "chunked_attention" else {} for t in types]
    return types, kwargs


#: the oldest release whose hybrid models treespec/recurrent.py is checked against (tests/core/test_hybrids.py passes
#: on 5.19 and 5.24; on 5.8.1 LFM2's cached multi-token path disagrees with its own greedy decoding)
HYBRID_MIN_VERSION = (5, 19)


def release(version: str = TRANSFORMERS_VERSION) -> tuple[int, int]:
    """(major, minor) of a transformers version string."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


#: transformers' ``generate(eos_token_id=...)`` for "never stop early", accepted by every supported release
NO_EOS: list[int] = []


def empty_layer(layer) -> None:
    """Leave a ``DynamicLayer`` holding nothing, uninitialised, as 5.24's ``reset`` does (5.8's keeps zeros)."""
    layer.keys = layer.values = None
    layer.is_initialized = False


def prefill_kwargs(model) -> dict:
    """``logits_to_keep=1`` where the model's forward takes it (transformers' causal LMs), else nothing."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

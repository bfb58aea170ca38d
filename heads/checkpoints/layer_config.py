"""A feature drafter's own decoder layer, configured from the target's: one layer, full attention (its tree
expansion rolls a plain KV cache back) and an attention implementation that takes a float tree mask. EAGLE-1's
layer (heads/eagle/network.py), EAGLE-3's (heads/eagle3/layer.py) and the upstream layouts'
(heads/checkpoints/upstream_common.py)
all start from it.
"""

from __future__ import annotations

import copy

from treespec.compat import layer_types_and_kwargs
from treespec.visibility import DENSE_MASK_ATTENTION


def set_full_attention(config) -> bool:
    """Make every layer of ``config`` a full-attention one where it keys them by a settable ``layer_types``
    (Gemma-2/3, gpt-oss, Qwen2, Qwen3.5); False where it has none, or derives it from other fields (Jamba,
    Bamba, Falcon-H1: a read-only property)."""
    if not getattr(config, "layer_types", None):
        return False
    try:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    except AttributeError:
        return False
    return True


# config keys that place a hybrid's attention layers (Jamba's period and offset, Bamba's indices), set so that
# the drafter's single layer is an attention one
HYBRID_ATTENTION_AT_0 = {"attn_layer_period": 1, "attn_layer_offset": 0, "attn_layer_indices": [0],
                         "layers_block_type": ["full_attention"]}  # Nemotron-H's list (read-only elsewhere)


def one_layer_config(target_config):
    """The target's config with one decoder layer, full attention (a DynamicCache) and a tree-mask
    capable attention implementation.

    Full attention also for a sliding-window target (Mistral, Gemma-2/3, gpt-oss): the drafter is trained on its
    own, over features that already carry the target's windowed context, and a full layer's cache is rolled back
    by plain compaction (treespec/cache.py)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    # hybrids that derive their layer types from where attention sits (Jamba, Bamba): attention at layer 0
    for key, value in HYBRID_ATTENTION_AT_0.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except AttributeError:  # derived from the others (Bamba's, Falcon-H1's layers_block_type)
                pass
    if set_full_attention(config):  # models keying masks by layer type (Gemma-2/3, gpt-oss, Qwen2)
        pass
    elif getattr(config, "sliding_window", None) is not None:  # one window for every layer (Mistral, Phi-3, Mixtral)
        config.sliding_window = None
    types, _ = layer_types_and_kwargs(config.get_text_config(decoder=True))
    if types != ["full_attention"]:  # e.g. Falcon-H1, whose every layer runs a Mamba mixer beside attention
        raise ValueError(f"an EAGLE layer of {config.model_type}'s own class would be a {types[0]!r} layer, whose "
                         "state the drafter's tree expansion cannot roll back: EAGLE needs a family with a "
                         "full-attention decoder layer")
    if getattr(config, "_attn_implementation", None) not in DENSE_MASK_ATTENTION:  # expansion passes a float mask
        config._attn_implementation = "sdpa"
    return config

"""EAGLE-3's decoder layer and which classes build it: Llama's by default, or the target's own.

**Llama-style by default, whatever the target.** Upstream trains and serves EAGLE-3 layers as Llama layers:
SpecForge builds ``LlamaForCausalLMEagle3`` for Llama, Qwen2/3 and other targets alike, the speculators library
a ``LlamaDecoderLayer``, and vLLM (``Eagle3LlamaForCausalLM``) and SGLang (``LlamaForCausalLMEagle3``) serve
only that. A layer built from, say, Qwen3's classes carries q/k norms none of them can hold, so a head trained
that way could be exported nowhere. ``layer="llama"`` (the default) therefore builds transformers' Llama
attention, MLP, RMSNorm and rotary embedding from a ``LlamaConfig`` carrying the target's sizes (hidden size,
heads, KV heads, head_dim, MLP width, activation, norm eps, RoPE), without biases; for a Llama target that is
its own config. ``layer="target"`` builds the layer from the target's own stock classes instead (Qwen2's q/k/v
biases, Qwen3's q/k norms), which treespec drafts with as well but which only treespec can load.

The layer itself (Li et al. 2025): attention over cat(input_layernorm(embedding), hidden_norm(h)), q/k/v
reading 2H inputs, the residual taken from h, then the post-attention norm and MLP.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from treespec.compat import cache_arg
from treespec.heads.checkpoints.layer_config import one_layer_config

LAYERS = ("llama", "target")  # which classes build the layer (module docstring); "llama" is the default


def check_layer_choice(layer: str) -> str:
    if layer not in LAYERS:
        raise ValueError(f"EAGLE-3 layer must be one of {LAYERS} (llama: what every upstream consumer serves; "
                         f"target: the target's own classes), got {layer!r}")
    return layer


def llama_like_parts(target):
    """(base model, its first decoder layer) of a target whose layers have Llama's parts."""
    base = target.base_model
    block = getattr(base, "layers", [None])[0]
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if block is None or not all(hasattr(block, a) for a in needed) or not hasattr(base, "rotary_emb") \
            or not hasattr(base, "norm"):
        raise ValueError(f"EAGLE-3 with layer='target' needs a Llama-like target (decoder layers with "
                         f"{', '.join(needed)}, a rotary embedding and a final norm); {type(target).__name__} is not "
                         "one: use layer='llama'")
    return base, block


def llama_layer_config(target_config) -> LlamaConfig:
    """A one-layer LlamaConfig with the target's sizes, norm eps and RoPE (the target's own config when it is a
    Llama), attention as one_layer_config sets it, no biases."""
    if getattr(target_config, "model_type", None) == "llama":
        return one_layer_config(target_config)
    tc = target_config.get_text_config(decoder=True)
    heads = tc.num_attention_heads
    rope = copy.deepcopy(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if "full_attention" in rope:  # per layer type (Gemma-2/3): the full-attention layers' RoPE
        rope = rope["full_attention"]
    config = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                         intermediate_size=getattr(tc, "intermediate_size", None) or 4 * tc.hidden_size,
                         num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                         head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                         hidden_act=getattr(tc, "hidden_act", None) or "silu",
                         rms_norm_eps=getattr(tc, "rms_norm_eps", None) or 1e-6,
                         max_position_embeddings=getattr(tc, "max_position_embeddings", None) or 2048,
                         rope_parameters=rope, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = one_layer_config(tc)._attn_implementation
    return config


def layer_config_for(target, layer: str):
    """The one-layer config the EAGLE-3 layer (``layer``: "llama" or "target") is built from."""
    return llama_layer_config(target.config) if layer == "llama" else one_layer_config(target.config)


def new_norm(target, config, layer: str) -> nn.Module:
    """An RMSNorm of the layer's class and eps, weights 1."""
    if layer == "llama":
        return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm = copy.deepcopy(llama_like_parts(target)[1].input_layernorm)  # the target's norm class and eps
    nn.init.ones_(norm.weight)
    return norm


def final_norm(target, config, layer: str) -> nn.Module:
    """The drafter's final norm, a warm start from the target's: a copy of it (``layer="target"``), or an RMSNorm
    holding its weights where the two compute the same (a Llama-like target), else weights 1."""
    base = target.base_model
    if layer == "target":
        return copy.deepcopy(llama_like_parts(target)[0].norm)
    norm = new_norm(target, config, layer)
    theirs = getattr(base, "norm", None)
    weight = getattr(theirs, "weight", None)
    if weight is None or weight.shape != norm.weight.shape:
        return norm
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(0))
        same = torch.allclose(norm(x), copy.deepcopy(theirs).float().cpu()(x), atol=1e-5)
    return norm if same else new_norm(target, config, layer)


def rotary_for(target, config, layer: str) -> nn.Module:
    """The layer's rotary embedding (its ``inv_freq`` is not persistent)."""
    if layer == "llama":
        return LlamaRotaryEmbedding(config=config)
    return type(llama_like_parts(target)[0].rotary_emb)(config=config)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer (module docstring), built from Llama's classes or the target's (``layer``)."""

    def __init__(self, target, config, layer: str = "llama"):
        super().__init__()
        h = config.hidden_size
        if layer == "llama":
            self.self_attn, self.mlp = LlamaAttention(config, layer_idx=0), LlamaMLP(config)
        else:
            _, block = llama_like_parts(target)
            self.self_attn, self.mlp = type(block.self_attn)(config, layer_idx=0), type(block.mlp)(config)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads 2H-wide inputs
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self, name, new_norm(target, config, layer))

    def forward(self, embeds, hidden, position_embeddings, attention_mask, cache):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [b, n, 2H]
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **cache_arg(cache))
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

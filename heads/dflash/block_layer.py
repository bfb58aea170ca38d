"""DFlash's decoder layer and the config it is built from: transformers' stock Qwen3 classes (attention projections
with per-head q/k norms, MLP, RMSNorm, rotary embedding) with the target's sizes, whatever the target, as z-lab
builds every DFlash drafter (a Qwen3-style config, ``DFlashDraftModel``); only the attention's forward is DFlash's
own (``attend``): the block's queries attend, without a causal mask, to the context's keys and values and to the
block's own.

**Context keys and values.** The target's hidden states at the drafter's target layers, side by side, projected once
(``hidden_norm(fc(·))``, heads/dflash/network.py), enter every layer through that layer's k/v projections (and its
k_norm, and RoPE at their own positions) without the layer's input norm, so a layer's context keys and values
depend on the features alone, not on the layers before it; the block's tokens go through the input norm, q/k/v,
q/k norms and RoPE as in a Qwen3 layer. Decoding keeps the context's keys and values in a cache, added as the
features arrive (heads/dflash/drafter.py); training computes the whole window's in the block's pass
(heads/dflash/objective.py).
"""

from __future__ import annotations

import json

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    ALL_ATTENTION_FUNCTIONS,
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    eager_attention_forward,
    rotate_half,
)

from treespec.heads.eagle3.layer import llama_layer_config

#: the layer's values a checkpoint may set apart from the target's (heads/dflash/upstream.py reads them from its
#: tensors and config.json); every other value is the target's (hidden size, vocabulary)
LAYER_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                "rms_norm_eps", "rope_parameters", "max_position_embeddings", "attention_bias")


def layer_config(target, num_layers: int, overrides: dict | None = None) -> Qwen3Config:
    """A Qwen3Config of ``num_layers`` full-attention layers with the target's sizes, norm eps and RoPE (what
    EAGLE-3's Llama layer takes, heads/eagle3/layer.py), no biases, ``overrides`` (keys of ``LAYER_FIELDS``) applied."""
    base = llama_layer_config(target.config)
    values = {key: getattr(base, key) for key in LAYER_FIELDS}
    rope = dict(values["rope_parameters"] or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("partial_rotary_factor", None)  # the draft's heads are rotated whole (a GPT-NeoX target's are not)
    values["rope_parameters"] = rope
    if overrides is not None and not isinstance(overrides, dict):  # a string was read as its letters
        raise ValueError(f"DFlash layer must be a dict of layer values ({', '.join(LAYER_FIELDS)}), got {overrides!r}")
    unknown = sorted(set(overrides or {}) - set(LAYER_FIELDS))
    if unknown:
        raise ValueError(f"DFlash layer values {unknown} cannot be set; it takes {', '.join(LAYER_FIELDS)}")
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    config = Qwen3Config(vocab_size=base.vocab_size, hidden_size=base.hidden_size, num_hidden_layers=int(num_layers),
                         use_sliding_window=False, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **values)
    config._attn_implementation = base._attn_implementation  # sdpa or eager: both take a float mask
    return config


def layer_values(config: Qwen3Config) -> dict:
    """``LAYER_FIELDS`` of ``config``, JSON-normalised (a treespec folder's ``layer``)."""
    return json.loads(json.dumps({key: getattr(config, key) for key in LAYER_FIELDS}))


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on heads ``x`` [b, heads, n, d] at the positions of cos/sin [b or 1, n, d]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


def keys_values(attn: Qwen3Attention, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (k_norm, RoPE) and values of ``x`` [b, n, H] → [b, kv_heads, n, d] each."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    keys = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
    return rotated(keys, *rope), attn.v_proj(x).view(shape).transpose(1, 2)


def held(cache, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``index``'s cached context keys and values, or None when it holds none."""
    if cache is None or len(cache.layers) <= index or not cache.layers[index].is_initialized:
        return None
    return cache.layers[index].keys, cache.layers[index].values


def attend(attn: Qwen3Attention, x: torch.Tensor, rope, attention_mask: torch.Tensor | None,
           context: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The block ``x`` [b, q, H] (input-normed) attending to the context and to itself → attention output [b, q, H].

    ``context``: the context's keys and values [b, kv_heads, c, d] (``keys_values``; None: no context). Keys are the
    context's, then the block's; ``attention_mask`` (float, additive) is [b or 1, 1, q, c + q], None: every query sees
    every key. ``rope``: (cos, sin) at the block's positions."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    queries = rotated(attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2), *rope)
    keys, values = keys_values(attn, x, rope)
    if context is not None:
        keys, values = torch.cat([context[0], keys], dim=2), torch.cat([context[1], values], dim=2)
    implementation = attn.config._attn_implementation
    forward = eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
    out, _ = forward(attn, queries, keys, values, attention_mask, dropout=attn.attention_dropout if attn.training
                     else 0.0, scaling=attn.scaling, is_causal=False)
    return attn.o_proj(out.reshape(*x.shape[:-1], -1))


class DFlashLayer(nn.Module):
    """One DFlash decoder layer (module docstring): pre-norm attention over context and block, then the MLP."""

    def __init__(self, config: Qwen3Config, index: int):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx=index)
        self.self_attn.is_causal = False  # the block sees itself whole
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, rope, attention_mask, context) -> torch.Tensor:
        """The block ``x`` [b, q, H] → [b, q, H]; ``context``: this layer's context keys and values (``attend``)."""
        x = x + attend(self.self_attn, self.input_layernorm(x), rope, attention_mask, context)
        return x + self.mlp(self.post_attention_layernorm(x))

"""DFlash checkpoints in z-lab's layout (``z-lab/*-DFlash*`` on the Hub; served as DFlash by SGLang's
``DFlashDraftModel`` and vLLM's ``dflash`` method), read and written without running any of their code: a
config.json and safetensors only.

**Layout.** A Qwen3-style ``config.json`` (``hidden_size``, ``intermediate_size``, heads, ``head_dim``,
``num_hidden_layers`` = the draft's layers, ``rms_norm_eps``, RoPE) with ``block_size``, ``num_target_layers`` and
``dflash_config: {target_layer_ids, mask_token_id}`` (SGLang also reads ``dflash_config.block_size`` first, and a
top-level ``target_layer_ids``); tensors ``fc.weight`` [H, K·H], ``hidden_norm.weight``, ``norm.weight`` and per
layer ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``,
optionally behind a ``model.`` prefix; no embeddings and no lm_head (the target's are used).

**Conventions.** ``target_layer_ids`` are decoder-layer outputs (``hidden_states[id + 1]``), as treespec's DFlash
stores them; absent, z-lab's default for K = the draft's layer count (heads/dflash/network.py). ``mask_token_id``
is required: SGLang can instead resolve ``dflash_config.mask_token`` (default ``<|MASK|>``) through the tokenizer,
which a weights-only loader does not read. A checkpoint whose ``num_target_layers``, hidden size or vocabulary
differs from the target's is refused, naming the difference.
"""

from __future__ import annotations

import re

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.checkpoints.upstream_common import (
    Refused,
    base_config,
    check_vocab,
    layer_counts,
    load_state,
    strip_model_prefix,
)
from treespec.heads.dflash.block_layer import LAYER_FIELDS
from treespec.heads.dflash.network import DFlashModel, resolve_target_layers

ARCHITECTURE = "DFlashDraftModel"  # z-lab's class, and the name SGLang's and vLLM's DFlash models register
LAYER_KEY = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight"
                       r"|mlp\.(gate|up|down)_proj\.weight|(input_layernorm|post_attention_layernorm)\.weight)$")
TOP_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"}
CONSUMERS = ("sglang", "vllm")  # the exports that write this layout


def dflash_config_of(config: dict) -> dict:
    nested = config.get("dflash_config")
    return nested if isinstance(nested, dict) else {}


def is_dflash(weights: dict, config: dict) -> bool:
    """z-lab's layout: a ``dflash_config`` or the DFlashDraftModel architecture in config.json, or a top-level
    ``hidden_norm`` beside ``fc`` and numbered layers (EAGLE-3 keeps its hidden_norm inside its one layer)."""
    if isinstance(config.get("dflash_config"), dict) or ARCHITECTURE in (config.get("architectures") or []):
        return True
    keys = set(strip_model_prefix(weights, "DFlash weights")) if weights else set()
    return TOP_KEYS - {"norm.weight"} <= keys and any(LAYER_KEY.match(k) for k in keys)


def dflash_from_upstream(weights: dict, config: dict, target, where: str) -> DFlashModel:
    """A z-lab DFlash checkpoint (module docstring) → a DFlashModel for ``target``; anything that does not fit
    the layout or the target is a ValueError naming it."""
    weights = strip_model_prefix(weights, where)
    unknown = sorted(k for k in weights if k not in TOP_KEYS and not LAYER_KEY.match(k))
    if unknown:
        own = [k for k in unknown if k in ("embed_tokens.weight", "lm_head.weight")]
        raise ValueError(f"{where}: tensors a DFlash drafter does not have: {', '.join(unknown[:8])}"
                         + (" (DFlash uses the target's embeddings and lm_head; a table of its own is not supported)"
                            if own else ""))
    for key in sorted(TOP_KEYS):
        if key not in weights:
            raise ValueError(f"{where}: missing {key}")
    tc = target.config.get_text_config(decoder=True)
    n, h = tc.num_hidden_layers, tc.hidden_size
    fc = weights["fc.weight"]
    if fc.dim() != 2 or fc.shape[0] != h:
        raise ValueError(f"{where}: the drafter's hidden size is {fc.shape[0]} (fc.weight {tuple(fc.shape)}), the "
                         f"target's {h}; DFlash shares the target's embeddings and lm_head, so they must be equal")
    if config.get("hidden_size") not in (None, h):
        raise ValueError(f"{where}: hidden_size {config['hidden_size']} (config.json) but the target's is {h}")
    if config.get("num_target_layers") not in (None, n):
        raise ValueError(f"{where}: made for a target of {config['num_target_layers']} layers (num_target_layers), "
                         f"the target has {n}")
    check_vocab(config, target, where)
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError(f"{where}: sliding-window draft layers (layer_types {config.get('layer_types')}, "
                         f"sliding_window {config.get('sliding_window')}) are not supported: every DFlash layer here "
                         "attends to the whole context")
    layers = sorted({int(LAYER_KEY.match(k).group(1)) for k in weights if LAYER_KEY.match(k)})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"{where}: decoder layers {layers} are not numbered 0..{max(layers, default=0)}")
    if config.get("num_hidden_layers") not in (None, len(layers)):
        raise ValueError(f"{where}: num_hidden_layers {config['num_hidden_layers']} (config.json) but the tensors "
                         f"hold {len(layers)} layers")
    nested = dflash_config_of(config)
    ids = nested.get("target_layer_ids", config.get("target_layer_ids"))
    try:
        ids = resolve_target_layers(ids, n, len(layers))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if fc.shape[1] != len(ids) * h:
        raise ValueError(f"{where}: fc.weight {tuple(fc.shape)} projects {fc.shape[1] / h:g} target states of size "
                         f"{h}, but {len(ids)} target layers {list(ids)} are configured")
    mask = nested.get("mask_token_id")
    if mask is None:
        raise ValueError(f"{where}: dflash_config has no mask_token_id (SGLang resolves dflash_config.mask_token, "
                         "default '<|MASK|>', through the tokenizer, which treespec does not read): add the token's id "
                         "to config.json's dflash_config")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab_size_of(target):
        raise ValueError(f"{where}: dflash_config.mask_token_id {mask!r} is not a token id of the target's "
                         f"{vocab_size_of(target)}-token vocabulary")
    block = nested.get("block_size", config.get("block_size", 16))  # SGLang's order and default
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"{where}: block_size {block!r} must be an integer >= 2")
    values = layer_counts(config, target, "layers.0.", weights, where, head_dim=config.get("head_dim"))
    values["attention_bias"] = any(k.endswith("_proj.bias") for k in weights)
    if config.get("max_position_embeddings"):
        values["max_position_embeddings"] = int(config["max_position_embeddings"])
    try:
        model = DFlashModel(target, block_size=block, num_layers=len(layers), target_layer_ids=ids,
                            mask_token_id=mask, layer={k: v for k, v in values.items() if k in LAYER_FIELDS})
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return load_state(model, weights, where)


def dflash_to_upstream(model: DFlashModel, target, consumer: str) -> tuple[dict, dict]:
    """(config.json, tensors) of a DFlashModel in z-lab's layout, which SGLang and vLLM serve as DFlash; other
    consumers are refused."""
    if consumer not in CONSUMERS:
        raise Refused(f"{consumer} has no DFlash drafter; DFlash exports to {' and '.join(CONSUMERS)} (z-lab's layout)")
    if model.root_norm is not None:
        raise Refused(f"{consumer} serves z-lab's DFlash, which does not add the root's feature to the block: a "
                      "drafter trained with root_feature: true decodes in treespec only")
    c = model.layer_config
    if c.hidden_act != "silu":
        raise Refused(f"SGLang's DFlash MLP supports hidden_act 'silu' only, this drafter's is {c.hidden_act!r}")
    n = target.config.get_text_config(decoder=True).num_hidden_layers
    config = base_config(model, target, ARCHITECTURE, c, model.dtype)
    config.update({"model_type": "qwen3", "attention_bias": bool(c.attention_bias), "attention_dropout": 0.0,
                   "use_sliding_window": False, "block_size": model.block_size, "num_target_layers": n,
                   "dflash_config": {"target_layer_ids": list(model.target_layer_ids),
                                     "mask_token_id": model.mask_token_id, "block_size": model.block_size}})
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    return config, tensors


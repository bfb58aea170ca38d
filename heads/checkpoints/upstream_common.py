"""What the upstream checkpoint formats share (heads/eagle/upstream.py: EAGLE-1/2; upstream_eagle3.py:
EAGLE-3; upstream_medusa.py): the refusal an export raises, key prefixes, RoPE fields as configs spell them,
a drafter layer's counts read from its tensors, biases settled to what a consumer builds, and the
LlamaConfig-like fields every EAGLE consumer reads.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.checkpoints.layer_config import one_layer_config
from treespec.io import check_float_weights


class Refused(ValueError):
    """An export refused: the consumer cannot represent this drafter (the message says what and why)."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "org/name" (or a legacy bare "name") on the Hub


def verifier_name(target, verifier: str | None, consumer: str, *, required: bool) -> str | None:
    """The target's name as ``consumer`` records it for loading the target later (speculators' verifier, Medusa's
    base model): ``verifier`` when given, else the target's ``_name_or_path`` when that is a Hub id, else None.
    A target loaded from a local folder has no name another machine can resolve (speculators' from_pretrained
    fails there with HFValidationError): with ``required``, that is a ValueError asking for ``verifier``."""
    if verifier:
        return str(verifier)
    name = str(getattr(target.config, "_name_or_path", None) or "")
    local = bool(name) and (os.path.isabs(name) or os.path.exists(name) or name.startswith((".", "~"))
                            or not HUB_ID.match(name))
    if not local:
        return name or None
    if required:
        raise ValueError(f"the target was loaded from the local folder {name}, which {consumer} would record as the "
                         "verifier to load, and which no other machine has: give the target's Hugging Face Hub id "
                         f"(or another name your {consumer} setup resolves) with verifier='org/name' "
                         "(scripts/export_drafter.py --verifier org/name)")
    return None


def strip_model_prefix(weights: dict, where: str) -> dict:
    """Keys without a leading ``model.`` (SGLang-style exports put the drafter's modules under it); two keys
    that become one are an error naming both."""
    out = {}
    for key, value in weights.items():
        short = key[len("model."):] if key.startswith("model.") else key
        if short in out:
            raise ValueError(f"{where}: both {key!r} and {short!r} are present; which one is meant is ambiguous")
        out[short] = value
    return out


def rope_parameters_of(config: dict) -> dict:
    """transformers-5 ``rope_parameters`` from an upstream draft config: its own ``rope_parameters`` if it has
    them, else ``rope_theta`` (10000 when absent — the draft's, never the target's) with ``rope_scaling``
    (``type`` or ``rope_type`` and their parameters)."""
    if isinstance(config.get("rope_parameters"), dict):
        params = dict(config["rope_parameters"])
        params.setdefault("rope_type", params.pop("type", "default"))
        params.setdefault("rope_theta", float(config.get("rope_theta", 10000.0)))
        return params
    theta = float(config.get("rope_theta") if config.get("rope_theta") is not None else 10000.0)
    scaling = config.get("rope_scaling")
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    params = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    params["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    params["rope_theta"] = theta
    return params


def rope_fields(params: dict) -> dict:
    """Config fields for ``rope_parameters``: transformers 5's own, mirrored as ``rope_theta`` and
    ``rope_scaling`` (with both ``type`` and ``rope_type``) for loaders that read those."""
    params = dict(params)
    kind = params.get("rope_type", "default")
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling["type"] = kind
    return {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_scaling": scaling, "rope_parameters": params}


def layer_overrides(target, values: dict) -> dict:
    """The entries of ``values`` (keys from ``LAYER_OVERRIDE_KEYS``) that differ from the target's one-layer
    config: what a drafter's own layers must replace."""
    base = one_layer_config(target.config)
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        current = getattr(base, key, None)
        if key == "head_dim" and current is None:  # configs without head_dim (Qwen2) mean hidden / heads
            current = base.hidden_size // base.num_attention_heads
        if key == "rope_parameters":
            current = {k: v for k, v in (current or {}).items()}
            same = {k: (float(v) if isinstance(v, int | float) else v) for k, v in current.items()} == \
                {k: (float(v) if isinstance(v, int | float) else v) for k, v in value.items()}
        else:
            same = current == value
        if not same:
            out[key] = value
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_counts(config: dict, target, prefix: str, weights: dict, where: str, head_dim=None) -> dict:
    """Head counts and widths of the drafter's layer(s) from its tensors (never from config counts alone)
    and the config's non-count fields: values for ``LAYER_OVERRIDE_KEYS``."""
    h = target.config.hidden_size
    heads = int(config.get("num_attention_heads") or target.config.num_attention_heads)
    d = int(head_dim or (h // heads))
    q, k = weights[f"{prefix}self_attn.q_proj.weight"], weights[f"{prefix}self_attn.k_proj.weight"]
    if q.shape[0] != heads * d or k.shape[0] % d or weights[f"{prefix}self_attn.v_proj.weight"].shape != k.shape:
        raise ValueError(f"{where}: q_proj {tuple(q.shape)} and k_proj {tuple(k.shape)} do not fit "
                         f"{heads} attention heads of size {d} (num_attention_heads {heads}, head_dim {d})")
    values = {"num_attention_heads": heads, "num_key_value_heads": k.shape[0] // d, "head_dim": d,
              "intermediate_size": weights[f"{prefix}mlp.gate_proj.weight"].shape[0],
              "rms_norm_eps": float(config.get("rms_norm_eps") or 1e-6), "hidden_act": config.get("hidden_act", "silu"),
              "rope_parameters": rope_parameters_of(config)}
    if values["rope_parameters"].get("rope_type") == "dynamic" and config.get("max_position_embeddings"):
        values["max_position_embeddings"] = int(config["max_position_embeddings"])
    return values


def check_vocab(config: dict, target, where: str, what: str = "vocab_size") -> None:
    v = vocab_size_of(target)
    if config.get(what) is not None and int(config[what]) != v:
        raise ValueError(f"{where}: the drafter was made for a vocabulary of {config[what]} tokens ({what}), the "
                         f"target has {v}: draft and target must share one tokenizer")


def own_embeddings(weights: dict, target, where: str) -> bool:
    """Whether a checkpoint's ``embed_tokens.weight`` must be kept: False when absent or equal to the
    target's table (a copy, the usual case); a mis-shaped one is an error."""
    table = weights.get("embed_tokens.weight")
    if table is None:
        return False
    mine = target.get_input_embeddings().weight
    if tuple(table.shape) != tuple(mine.shape):
        raise ValueError(f"{where}: embed_tokens.weight is {tuple(table.shape)}, the target's table is "
                         f"{tuple(mine.shape)} (vocabulary × hidden size): not a drafter for this target")
    return not torch.equal(table.to(mine.dtype).cpu(), mine.detach().cpu())


def load_state(model: nn.Module, state: dict, where: str):
    check_float_weights(state, model, where)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{where}: the tensors do not fit the drafter: {err}") from None
    return model.eval()



def layer_values(layer_config) -> dict:
    c = layer_config
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act}


def base_config(model, target, architecture: str, layer_config, dtype) -> dict:
    """The LlamaConfig-like fields every EAGLE consumer reads."""
    tc = target.config
    max_positions = max(int(getattr(tc, "max_position_embeddings", 0) or 0),
                        int(getattr(layer_config, "max_position_embeddings", 0) or 0))
    return {"architectures": [architecture], "model_type": "llama", **layer_values(layer_config),
            "vocab_size": vocab_size_of(target), "max_position_embeddings": max_positions,
            **rope_fields(layer_config.rope_parameters), "tie_word_embeddings": False,
            "bos_token_id": getattr(tc, "bos_token_id", None), "eos_token_id": getattr(tc, "eos_token_id", None),
            "pad_token_id": getattr(tc, "pad_token_id", None), "torch_dtype": dtype_name(dtype)}


def settle_biases(state: dict, expected: set[str], consumer: str, why: str) -> dict:
    """Make ``state``'s bias tensors exactly ``expected``: add zeros where a consumer builds a bias the drafter
    lacks, drop zero biases it does not build, and refuse (``Refused``) a nonzero one it would drop."""
    out = dict(state)
    for key in sorted(k for k in state if k.endswith(".bias") and k not in expected):
        if bool(state[key].abs().gt(0).any()):
            raise Refused(f"{consumer} cannot represent this drafter: it has no {key} ({why}), and this drafter's "
                          "is nonzero")
        del out[key]
    for key in sorted(expected - set(state)):
        weight = state[key.removesuffix(".bias") + ".weight"]
        out[key] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return out


def nonzero(state: dict, pattern: str) -> bool:
    return any(bool(v.abs().gt(0).any()) for k, v in state.items() if re.match(pattern, k))


def bias_keys(state: dict, pattern: str) -> set[str]:
    """The bias keys of every weight whose name (without ``.weight``) matches ``pattern``."""
    return {k.removesuffix(".weight") + ".bias" for k in state if k.endswith(".weight")
            and re.match(pattern, k.removesuffix(".weight"))}



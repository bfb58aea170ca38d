"""EAGLE-1/2 and EAGLE-3 checkpoints as other projects write and read them, converted to and from treespec's
``EagleModel`` (variant "upstream") and ``Eagle3Model``. heads/load.py reads the files and calls the
``*_from_upstream`` functions; heads/export.py calls the ``*_to_upstream`` ones and writes the files.

**EAGLE-1/2** (SafeAILab/EAGLE ``cnets1.py``; branch v1 ``cnets.py``): keys unprefixed, ``fc.weight`` [H, 2H]
(+ ``fc.bias`` unless config ``"bias": false``; absent flag = true), ``layers.{i}.self_attn.{q,k,v,o}_proj``
(+ q/k/v biases when ``"qkv_bias": true``), ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.post_attention_layernorm`` and, for i >= 1 only, ``layers.{i}.input_layernorm``; optionally
``embed_tokens.weight`` (a copy of the target's table); no final norm, no lm_head. Forward, checked in
``Model.forward``: ``x = fc(torch.cat((inputs_embeds, hidden_states), dim=-1))`` — the token EMBEDDING
FIRST, the target feature second — then the layers (layer 0 without input norm), no final norm, and the
target's lm_head on the result. RoPE is the draft config's (``rope_theta``, 10000 when absent; linear or
dynamic ``rope_scaling``), head_dim = hidden / heads.

**EAGLE-3** (SafeAILab/EAGLE ``cnets.py``; SpecForge; vLLM ``llama_eagle3.py``; SGLang ``llama_eagle3.py``;
speculators ``eagle3``): ``fc.weight`` [H, 3·Ht], the layer as ``midlayer.*`` (official, SGLang, SpecForge)
or ``layers.0.*`` (vLLM, speculators), optionally behind a ``model.`` prefix, ``norm.weight``,
``lm_head.weight`` [draft_vocab, H], ``d2t`` / ``t2d`` (absent for the full vocabulary), optionally
``embed_tokens.weight``. ``norm_before_residual`` (speculators, vLLM): the residual is the NORMED feature.

**Aux layers** (which target hidden states EAGLE-3 fuses). treespec indexes transformers'
``hidden_states``: ``hidden_states[i]`` is the input of decoder layer i (0 = the embeddings, L = the final
norm's output). Conventions found upstream:

=============================================  =======================  ===============================
where the ids are                               convention               treespec index
=============================================  =======================  ===============================
top-level ``eagle_aux_hidden_state_layer_ids``  input of layer i          i       (vLLM, speculators)
``eagle_config.eagle_aux_hidden_state_...``     output of layer i        i + 1   (SGLang, SpecForge)
absent                                          (2, L//2, L-3) inputs    as is   (official EAGLE, vLLM,
                                                                                  SGLang and speculators
                                                                                  defaults)
=============================================  =======================  ===============================

vLLM also reads the nested ids when no top-level ones exist, as inputs: a nested-only config is read
here as SGLang reads it (that is who writes them); ``load(..., aux_layers=...)`` overrides. Exports write
each consumer's own field only (vLLM and speculators: top level; SGLang: nested, minus one).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from .checkpoint import load_drafter, vocab_size_of
from .eagle import LAYER_OVERRIDE_KEYS, EagleModel, apply_layer_overrides, conform_linear_biases, one_layer_config
from .eagle3 import Eagle3Layer, Eagle3Model
from .eagle3 import check_fits_target as check_fits_eagle3
from .vocab import DraftVocab

# -- shared -------------------------------------------------------------------------------------------------


class Refused(ValueError):
    """An export refused: the consumer cannot represent this drafter (the message says what and why)."""


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


def _counts(config: dict, target, prefix: str, weights: dict, where: str, head_dim=None) -> dict:
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


def _check_vocab(config: dict, target, where: str, what: str = "vocab_size") -> None:
    v = vocab_size_of(target)
    if config.get(what) is not None and int(config[what]) != v:
        raise ValueError(f"{where}: the drafter was made for a vocabulary of {config[what]} tokens ({what}), the "
                         f"target has {v}: draft and target must share one tokenizer")


def _own_embeddings(weights: dict, target, where: str) -> bool:
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


def _load(model: nn.Module, state: dict, where: str):
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{where}: the tensors do not fit the drafter: {err}") from None
    return model.eval()


# -- EAGLE-1 / EAGLE-2 --------------------------------------------------------------------------------------
EAGLE_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(self_attn\.[qkvo]_proj\.(weight|bias)"
                             r"|mlp\.(gate|up|down)_proj\.(weight|bias)"
                             r"|input_layernorm\.weight|post_attention_layernorm\.weight)$")
EAGLE_KNOWN_UNSUPPORTED = {"embedding_layernorm.weight": "HASS's add_para_norm",
                           "hidden_states_layernorm.weight": "HASS's add_para_norm", "norm.weight": "a final norm",
                           "lm_head.weight": "an lm_head of its own"}


def is_eagle1(weights: dict, hidden: int | None = None) -> bool:
    fc = weights.get("fc.weight")
    return fc is not None and fc.dim() == 2 and fc.shape[1] == 2 * fc.shape[0] \
        and any(EAGLE_LAYER_KEY.match(k) for k in weights) and not any(".hidden_norm." in k for k in weights)


def eagle_from_upstream(weights: dict, config: dict, target, where: str) -> EagleModel:
    """An EAGLE-1/2 checkpoint (tensors with upstream names, its config.json) → ``EagleModel(variant="upstream")``
    for ``target``; anything that does not fit the published layout or the target is a ValueError."""
    weights = strip_model_prefix(weights, where)
    unknown = sorted(k for k in weights if not EAGLE_LAYER_KEY.match(k) and k not in ("fc.weight", "fc.bias",
                                                                                        "embed_tokens.weight"))
    if unknown:
        why = [f"{k} ({EAGLE_KNOWN_UNSUPPORTED[k]})" for k in unknown if k in EAGLE_KNOWN_UNSUPPORTED]
        raise ValueError(f"{where}: tensors an EAGLE-1 drafter does not have: {', '.join(why or unknown[:8])}"
                         + (" — not supported" if why else ""))
    fc, h = weights["fc.weight"], target.config.hidden_size
    if fc.shape[0] != h or fc.shape[1] != 2 * fc.shape[0]:
        raise ValueError(f"{where}: fc.weight is {tuple(fc.shape)}; a drafter for this target (hidden size {h}) has "
                         f"fc [{h}, {2 * h}] (cat(embedding, feature) → hidden)")
    _check_vocab(config, target, where)
    layers = sorted({int(EAGLE_LAYER_KEY.match(k).group(1)) for k in weights if EAGLE_LAYER_KEY.match(k)})
    if layers != list(range(len(layers))):
        raise ValueError(f"{where}: decoder layers {layers} are not numbered 0..{len(layers) - 1}")
    if "layers.0.input_layernorm.weight" in weights:
        raise ValueError(f"{where}: layer 0 has an input_layernorm, which EAGLE-1 as published does not have "
                         "(a treespec-variant drafter? load its own folder instead)")
    missing = [f"layers.{i}.input_layernorm.weight" for i in layers[1:] if f"layers.{i}.input_layernorm.weight"
               not in weights]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (layers after the first have an input norm)")
    flag = config.get("bias", True)  # ea_model.py: con["bias"], True when absent
    if bool(flag) != ("fc.bias" in weights):
        raise ValueError(f"{where}: config.json says fc {'has' if flag else 'has no'} bias (\"bias\": "
                         f"{str(bool(flag)).lower()}{', the default when absent' if 'bias' not in config else ''}) "
                         f"but fc.bias is {'missing' if flag else 'present'}; fix one of them")
    qkv = [k for k in weights if re.match(r"^layers\.\d+\.self_attn\.[qkv]_proj\.bias$", k)]
    if "qkv_bias" in config and bool(config["qkv_bias"]) != bool(qkv):
        raise ValueError(f"{where}: config.json says qkv_bias {config['qkv_bias']} but the q/k/v biases are "
                         f"{'present' if qkv else 'missing'}")
    values = _counts(config, target, "layers.0.", weights, where)
    values["num_hidden_layers"] = len(layers)
    own = _own_embeddings(weights, target, where)
    model = EagleModel(target, variant="upstream", layer_overrides=layer_overrides(target, values),
                       fc_bias="fc.bias" in weights, own_embeddings=own)
    state = {("decoder." + k if k.startswith("layers.") else k): v for k, v in weights.items()
             if k != "embed_tokens.weight" or own}
    conform_linear_biases(model, state)
    return _load(model, state, where)


def _upstream_eagle_state(model: EagleModel) -> dict:
    """An upstream-variant EagleModel's tensors under upstream names (no embed_tokens unless its own)."""
    out = {}
    for key, value in model.state_dict().items():
        out[key.removeprefix("decoder.")] = value.detach().contiguous()
    return out


def _layer_values(layer_config) -> dict:
    c = layer_config
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps, "hidden_act": c.hidden_act}


def _base_config(model, target, architecture: str, layer_config, dtype) -> dict:
    """The LlamaConfig-like fields every EAGLE consumer reads."""
    tc = target.config
    max_positions = max(int(getattr(tc, "max_position_embeddings", 0) or 0),
                        int(getattr(layer_config, "max_position_embeddings", 0) or 0))
    return {"architectures": [architecture], "model_type": "llama", **_layer_values(layer_config),
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


def _nonzero(state: dict, pattern: str) -> bool:
    return any(bool(v.abs().gt(0).any()) for k, v in state.items() if re.match(pattern, k))


def _bias_keys(state: dict, pattern: str) -> set[str]:
    """The bias keys of every weight whose name (without ``.weight``) matches ``pattern``."""
    return {k.removesuffix(".weight") + ".bias" for k in state if k.endswith(".weight")
            and re.match(pattern, k.removesuffix(".weight"))}


def eagle_to_upstream(model: EagleModel, target, consumer: str) -> tuple[dict, dict]:
    """(config.json, tensors) of an EagleModel for ``consumer``: "sglang" (LlamaForCausalLMEagle), "vllm"
    (EagleLlamaForCausalLM) or "eagle" (SafeAILab/EAGLE). ``Refused`` names what a consumer cannot hold."""
    if getattr(model, "variant", "treespec") != "upstream":
        raise Refused(f"{consumer} cannot represent a treespec-variant EAGLE drafter: it has an input norm on layer "
                      "0 and a final norm, which EAGLE-1 as published (and every consumer of it) lacks. Train it "
                      "with EagleModel(target, variant='upstream') (drafter.variant=upstream)")
    if model.fusion is not None or tuple(model.feature_layers) not in ((-1,), (target.config.num_hidden_layers,)):
        raise Refused(f"{consumer} cannot represent a fused EAGLE drafter (feature_layers {model.feature_layers}): "
                      "EAGLE-1 consumers feed the target's last hidden state only; export it as EAGLE-3 instead")
    c = model.layer_config
    if consumer in ("sglang", "vllm") and c.hidden_act != "silu":
        raise Refused(f"{consumer}'s Llama MLP supports hidden_act 'silu' only, this drafter's is {c.hidden_act!r}")
    if consumer in ("sglang", "vllm") and model.embed_tokens is not None:
        raise Refused(f"{consumer} embeds draft tokens with the target's table; this drafter has a table of its own")
    state = _upstream_eagle_state(model)
    n = c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    config = _base_config(model, target, {"sglang": "LlamaForCausalLMEagle", "vllm": "EagleLlamaForCausalLM",
                                          "eagle": "LlamaForCausalLM"}[consumer], c, model.dtype)
    qkv, o, mlp = r"^layers\.\d+\.self_attn\.[qkv]_proj$", r"^layers\.\d+\.self_attn\.o_proj$", r"^layers\.\d+\.mlp\."
    if consumer == "sglang":  # fc always has a bias; attention_bias (or bias) gives q, k, v AND o biases
        attention = _nonzero(state, qkv.replace("$", r"\.bias$")) or _nonzero(state, o.replace("$", r"\.bias$"))
        expected = {"fc.bias"} | (_bias_keys(state, qkv) | _bias_keys(state, o) if attention else set())
        state = settle_biases(state, expected, consumer, "SGLang's Llama layers have q/k/v/o biases together, "
                              "with config attention_bias, and no MLP biases")
        config.update({"attention_bias": attention})
    elif consumer == "vllm":  # fc has no bias; qkv_bias → q/k/v; attention_bias (or bias) → o_proj
        q_on, o_on = _nonzero(state, qkv.replace("$", r"\.bias$")), _nonzero(state, o.replace("$", r"\.bias$"))
        m_on = _nonzero(state, mlp + r".*\.bias$")
        expected = (_bias_keys(state, qkv) if q_on else set()) | (_bias_keys(state, o) if o_on else set()) \
            | (_bias_keys(state, mlp) if m_on else set())
        state = settle_biases(state, expected, consumer, "vLLM's EAGLE fc is built without a bias")
        config.update({"bias": False, "qkv_bias": q_on, "attention_bias": o_on, "mlp_bias": m_on})
    else:  # SafeAILab/EAGLE: fc bias per "bias", q/k/v per "qkv_bias", never o_proj or MLP biases
        if head_dim * c.num_attention_heads != c.hidden_size:
            raise Refused(f"SafeAILab/EAGLE uses head_dim = hidden / heads = {c.hidden_size // c.num_attention_heads}"
                          f", this drafter's is {head_dim}")
        kind = c.rope_parameters.get("rope_type", "default")
        if kind not in ("default", "linear", "dynamic"):
            raise Refused(f"SafeAILab/EAGLE supports linear and dynamic rope_scaling only, this drafter's is {kind!r}")
        q_on = _nonzero(state, qkv.replace("$", r"\.bias$"))
        expected = ({"fc.bias"} if "fc.bias" in state else set()) | (_bias_keys(state, qkv) if q_on else set())
        state = settle_biases(state, expected, consumer, "SafeAILab/EAGLE's layers have q/k/v biases at most")
        state.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.detach().to(model.dtype).cpu())
        config.update({"bias": "fc.bias" in state, "qkv_bias": q_on, "pretraining_tp": 1})
        if config["rope_scaling"]:
            config["rope_scaling"] = {"type": kind, "factor": c.rope_parameters.get("factor", 1.0)}
    config["num_hidden_layers"] = n
    return config, {k: v.contiguous() for k, v in state.items()}


# -- EAGLE-3 ------------------------------------------------------------------------------------------------
EAGLE3_LAYER_KEY = re.compile(r"^midlayer\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight"
                              r"|mlp\.(gate|up|down)_proj\.(weight|bias)"
                              r"|(input_layernorm|hidden_norm|post_attention_layernorm)\.weight)$")
EAGLE3_TOP_KEYS = {"fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
EAGLE3_UNSUPPORTED = {"fc_norm": "EAGLE 3.1's fc_norm (per-aux norms)", "input_norm": "norm_before_fc",
                      "midlayers": "more than one decoder layer", "mask_hidden": "parallel drafting (PEagle)"}


def is_eagle3(weights: dict) -> bool:
    keys = set(weights)
    return "fc.weight" in keys and any(".hidden_norm." in k for k in keys)


def normalize_eagle3_keys(weights: dict, where: str) -> dict:
    """``model.`` prefixes stripped, ``layers.0.`` → ``midlayer.``, ``draft_id_to_target_id`` → ``d2t``."""
    weights = strip_model_prefix(weights, where)
    out = {}
    for key, value in weights.items():
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        elif key == "draft_id_to_target_id":
            key = "d2t"
        if key in out:
            raise ValueError(f"{where}: the decoder layer is stored twice (midlayer.* and layers.0.*)")
        out[key] = value
    return out


def eagle3_aux_layers(config: dict, num_hidden_layers: int, where: str, aux_layers=None) -> tuple[int, ...]:
    """The target hidden-state indices an EAGLE-3 checkpoint fuses, in treespec's convention (module
    docstring): explicit ``aux_layers``, else the top-level ids (input of layer i), else SGLang's nested
    ``eagle_config`` ids (output of layer i: +1), else the published default (2, L//2, L-3)."""
    n = int(num_hidden_layers)
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if aux_layers is not None:
        ids, source = [int(i) for i in aux_layers], "aux_layers"
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        ids, source = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]], "eagle_aux_hidden_state_layer_ids"
    elif nested.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) + 1 for i in nested["eagle_aux_hidden_state_layer_ids"]]
        source = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of layer i = hidden_states[i + 1])"
    else:
        ids, source = [2, n // 2, n - 3], f"the published default (2, L//2, L-3) for L = {n}"
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"{where}: aux layers {ids} from {source} do not exist in a {n}-layer target (hidden_states "
                         f"0..{n}); pass load(..., aux_layers=[...]) with the indices it was trained with")
    return tuple(ids)


class UpstreamEagle3Layer(Eagle3Layer):
    """Eagle3Layer with speculators' ``norm_before_residual`` switch: the residual is hidden_norm(h), not h."""

    def __init__(self, target, config, norm_before_residual: bool = False):
        super().__init__(target, config)
        self.norm_before_residual = bool(norm_before_residual)

    def forward(self, embeds, hidden, position_embeddings, attention_mask, cache):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [b, n, 2H]
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, cache=cache)
        hidden = (normed if self.norm_before_residual else hidden) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _set_eps(norm: nn.Module, eps: float) -> None:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            setattr(norm, name, eps)
            return


class UpstreamEagle3Model(Eagle3Model):
    """An Eagle3Model whose layer follows an upstream checkpoint where it differs from the target's own
    config: ``layer_overrides`` (its RoPE, head count, MLP width, norm eps), ``norm_before_residual``,
    ``own_embeddings`` (a frozen ``embed_tokens`` of its own) and whatever biases its tensors hold. Saved as
    an "eagle3" folder whose config carries them under ``"upstream"``; heads/load.py reads it back."""

    def __init__(self, target, *, aux_layers=None, vocab_map=None, layer_overrides: dict | None = None,
                 norm_before_residual: bool = False, own_embeddings: bool = False):
        super().__init__(target, aux_layers=aux_layers, vocab_map=vocab_map)
        self.layer_config = apply_layer_overrides(one_layer_config(target.config), layer_overrides)
        self.midlayer = UpstreamEagle3Layer(target, self.layer_config, norm_before_residual)
        self.rotary_emb = type(target.base_model.rotary_emb)(config=self.layer_config)
        for norm in (self.midlayer.input_layernorm, self.midlayer.hidden_norm, self.midlayer.post_attention_layernorm,
                     self.norm):
            _set_eps(norm, self.layer_config.rms_norm_eps)
        self.embed_tokens = None
        if own_embeddings:
            self.embed_tokens = nn.Embedding(self.vocab_size, target.config.hidden_size).requires_grad_(False)
            self._embed = [self.embed_tokens]
        self.config["upstream"] = {"layer_overrides": copy.deepcopy(dict(layer_overrides or {})),
                                   "norm_before_residual": bool(norm_before_residual),
                                   "own_embeddings": bool(own_embeddings)}
        self.to(target.device)
        for p in self.parameters():
            p.data = p.data.to(target.dtype)

    @property
    def norm_before_residual(self) -> bool:
        return self.midlayer.norm_before_residual

    @classmethod
    def from_pretrained(cls, folder, target) -> Eagle3Model:
        """A folder saved by ``save_pretrained`` (kind "eagle3" with an ``"upstream"`` config entry)."""
        config, weights = load_drafter(folder, "eagle3")
        upstream = config.get("upstream")
        if not isinstance(upstream, dict) or not isinstance(config.get("eagle_aux_hidden_state_layer_ids"), list):
            raise ValueError(f"{folder}: not an upstream-layout EAGLE-3 drafter (its config lacks 'upstream')")
        check_fits_eagle3(config, target)
        try:
            model = cls(target, aux_layers=config["eagle_aux_hidden_state_layer_ids"],
                        vocab_map=(weights["d2t"], weights["t2d"]), **upstream)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"EAGLE-3 drafter in {folder}: {err}") from None
        conform_linear_biases(model, weights)
        return _load(model, weights, str(folder))


def eagle3_from_upstream(weights: dict, config: dict, target, where: str, aux_layers=None) -> Eagle3Model:
    """An EAGLE-3 checkpoint (official, SpecForge, SGLang, vLLM or speculators layout) → an Eagle3Model for
    ``target`` (an ``UpstreamEagle3Model`` where its layer differs from what the target's config builds)."""
    weights = normalize_eagle3_keys(weights, where)
    top = config
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{where}: speculators_model_type {config['speculators_model_type']!r} is not supported "
                             "(eagle3 is)")
        if not isinstance(config.get("transformer_layer_config"), dict):
            raise ValueError(f"{where}: a speculators config needs transformer_layer_config (a dict)")
        if "norm_before_residual" not in config:
            raise ValueError(f"{where}: this speculators config lacks norm_before_residual, which vLLM reads as true "
                             "and the speculators library as false; add the value it was trained with")
        config = {**config["transformer_layer_config"], **{k: v for k, v in config.items()
                                                           if k != "transformer_layer_config"}}
    for flag in ("fc_norm", "norm_before_fc", "norm_output"):
        if config.get(flag):
            raise ValueError(f"{where}: {flag}: true (EAGLE 3.1) is not supported")
    if isinstance(top.get("eagle_config"), dict) and top["eagle_config"].get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state is false (no feature fusion): not supported")
    unknown = sorted(k for k in weights if k not in EAGLE3_TOP_KEYS and not EAGLE3_LAYER_KEY.match(k))
    if unknown:
        why = {why for k in unknown for name, why in EAGLE3_UNSUPPORTED.items() if k.startswith(name)}
        why |= {"more than one decoder layer" for k in unknown if re.match(r"^layers\.[1-9]", k)}
        why = sorted(why)
        raise ValueError(f"{where}: tensors an EAGLE-3 drafter does not have: {', '.join(unknown[:8])}"
                         + (f" ({'; '.join(why)}: not supported)" if why else ""))
    for key in ("fc.weight", "norm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"):
        if key not in weights:
            raise ValueError(f"{where}: missing {key}")
    h, n = target.config.hidden_size, target.config.num_hidden_layers
    fc = weights["fc.weight"]
    if fc.shape[0] != h:
        raise ValueError(f"{where}: the drafter's hidden size is {fc.shape[0]} (fc.weight {tuple(fc.shape)}), the "
                         f"target's {h}; treespec's EAGLE-3 shares the target's token table, so they must be equal")
    if config.get("target_hidden_size") not in (None, h):
        raise ValueError(f"{where}: target_hidden_size {config['target_hidden_size']} (config.json) but the target's "
                         f"hidden size is {h}")
    aux = eagle3_aux_layers(top, n, where, aux_layers)
    if fc.shape[1] != len(aux) * h:
        raise ValueError(f"{where}: fc.weight {tuple(fc.shape)} fuses {fc.shape[1] / h:g} target states of size {h}, "
                         f"but {len(aux)} aux layers {list(aux)} are configured")
    q = weights["midlayer.self_attn.q_proj.weight"]
    if q.shape[1] != 2 * h:
        raise ValueError(f"{where}: midlayer q_proj reads {q.shape[1]} inputs; EAGLE-3's reads 2 × {h}")
    _check_vocab(config, target, where)
    vocab = vocab_size_of(target)
    draft_vocab = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else \
        int(config.get("draft_vocab_size") or vocab)
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if t2d is not None and t2d.numel() != vocab:
        raise ValueError(f"{where}: t2d has {t2d.numel()} entries, the target's vocabulary {vocab}")
    if d2t is None and t2d is None:
        if draft_vocab != vocab:
            raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} tokens (target: {vocab}) needs d2t (draft "
                             "id → target id offsets), which is missing")
        d2t, t2d = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    elif d2t is None:
        d2t = DraftVocab(torch.nonzero(t2d.bool()).flatten(), vocab).d2t
    elif t2d is None:
        try:
            t2d = DraftVocab(torch.arange(d2t.numel()) + d2t.long(), vocab).t2d
        except ValueError as err:
            raise ValueError(f"{where}: d2t does not describe a draft vocabulary: {err}") from None
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    if d2t.numel() != draft_vocab:
        raise ValueError(f"{where}: d2t has {d2t.numel()} entries for an lm_head of {draft_vocab} rows")
    values = _counts(config, target, "midlayer.", weights, where, head_dim=config.get("head_dim"))
    values["num_hidden_layers"] = 1
    overrides = layer_overrides(target, values)
    own = _own_embeddings(weights, target, where)
    nbr = bool(config.get("norm_before_residual", False))
    state = {k: v for k, v in weights.items() if k != "embed_tokens.weight" or own}
    state["d2t"], state["t2d"] = d2t, t2d
    try:
        if overrides or nbr or own:
            model = UpstreamEagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d), layer_overrides=overrides,
                                        norm_before_residual=nbr, own_embeddings=own)
        else:
            model = Eagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    state.setdefault("lm_head.weight", model.lm_head.weight.detach().clone())  # absent: the target's rows
    if conform_linear_biases(model, state, apply=False) and type(model) is Eagle3Model:
        model = UpstreamEagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d))
    conform_linear_biases(model, state)
    return _load(model, state, where)


def _eagle3_state(model: Eagle3Model, layer: str) -> dict:
    """Tensors under upstream names, the layer as ``layer`` ("midlayer." or "layers.0.")."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("midlayer."):
            key = layer + key[len("midlayer."):]
        out[key] = value.detach().contiguous()
    return out


def eagle3_to_upstream(model: Eagle3Model, target, consumer: str, *, verifier: str | None = None,
                       speculative_tokens: int = 3) -> tuple[dict, dict]:
    """(config.json, tensors) of an Eagle3Model for ``consumer``: "sglang" (LlamaForCausalLMEagle3), "vllm"
    (Eagle3LlamaForCausalLM), "speculators" (Eagle3Speculator, read by vLLM) or "eagle" (SafeAILab/EAGLE)."""
    n, h = target.config.num_hidden_layers, target.config.hidden_size
    c = model.layer_config
    nbr = bool(getattr(model, "norm_before_residual", False))
    own = getattr(model, "embed_tokens", None) is not None
    aux = [int(i) for i in model.aux_layers]
    if c.hidden_act != "silu" and consumer != "speculators":
        raise Refused(f"{consumer}'s Llama MLP supports hidden_act 'silu' only, this drafter's is {c.hidden_act!r}")
    if any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in model.state_dict()):
        raise Refused(f"{consumer} cannot represent q/k norms in the EAGLE-3 layer (a Qwen3-style target)")
    if consumer in ("sglang", "vllm", "speculators") and any(not 1 <= i <= n - 1 for i in aux):
        raise Refused(f"{consumer} captures aux hidden states at the inputs of decoder layers 1..{n - 1} only; this "
                      f"drafter fuses hidden_states {aux} (0 = embeddings, {n} = final norm output)")
    if consumer == "eagle" and aux != [2, n // 2, n - 3]:
        raise Refused(f"SafeAILab/EAGLE hard-codes aux layers (2, L//2, L-3) = {(2, n // 2, n - 3)}; this drafter "
                      f"fuses {aux}")
    if nbr and consumer in ("sglang", "eagle"):
        raise Refused(f"{consumer} has no norm_before_residual: its residual is the un-normed feature")
    if own and consumer == "sglang":
        raise Refused("SGLang embeds draft tokens with the target's table; this drafter has a table of its own")
    layer = "midlayer." if consumer in ("sglang", "eagle") else "layers.0."
    state = _eagle3_state(model, layer)
    if model.draft_vocab.is_full and consumer != "eagle":
        state.pop("d2t"), state.pop("t2d")  # optional for the full vocabulary; the official code needs them
    arch = {"sglang": "LlamaForCausalLMEagle3", "vllm": "Eagle3LlamaForCausalLM", "eagle": "LlamaForCausalLM",
            "speculators": "LlamaForCausalLM"}[consumer]
    config = _base_config(model, target, arch, c, model.dtype)
    config.update({"num_hidden_layers": 1, "draft_vocab_size": model.draft_vocab_size, "target_hidden_size": h})
    lay = re.escape(layer)
    qkv, o, mlp = lay + r"self_attn\.[qkv]_proj$", lay + r"self_attn\.o_proj$", lay + r"mlp\."
    bias = lambda pattern: _nonzero(state, pattern.replace("$", r"\.bias$"))  # noqa: E731
    if consumer == "sglang":  # q/k/v never; fc per "bias"; o_proj per attention_bias or bias
        fc_on = bias(r"^fc$")
        o_on = fc_on or bias(o)
        expected = ({"fc.bias"} if fc_on else set()) | (_bias_keys(state, o) if o_on else set())
        state = settle_biases(state, expected, consumer, "SGLang's EAGLE-3 q/k/v projections are built without biases")
        config.update({"bias": fc_on, "attention_bias": o_on,
                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                        "use_aux_hidden_state": True}})
    elif consumer in ("vllm", "speculators"):  # fc never; attention_bias → q/k/v and o_proj; mlp_bias → MLP
        a_on, m_on = bias(qkv) or bias(o), _nonzero(state, mlp + r".*\.bias$")
        expected = (_bias_keys(state, qkv) | _bias_keys(state, o) if a_on else set()) | \
            (_bias_keys(state, mlp) if m_on else set())
        state = settle_biases(state, expected, consumer, f"{consumer}'s EAGLE-3 fc is built without a bias")
        config.update({"attention_bias": a_on, "mlp_bias": m_on, "norm_before_residual": nbr,
                       "eagle_aux_hidden_state_layer_ids": aux})
        if consumer == "vllm":
            config["bias"] = False
    else:
        state = settle_biases(state, set(), consumer, "SafeAILab/EAGLE's EAGLE-3 layer has no biases")
        if c.rope_parameters.get("rope_type", "default") not in ("default", "linear", "dynamic"):
            raise Refused("SafeAILab/EAGLE supports linear and dynamic rope_scaling only")
        if config["rope_scaling"]:
            config["rope_scaling"] = {"type": c.rope_parameters["rope_type"], "factor": c.rope_parameters.get("factor")}
        config["pretraining_tp"] = 1
    if consumer == "speculators":
        layer_config = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "target_hidden_size",
                                                                     "norm_before_residual", "architectures",
                                                                     "eagle_aux_hidden_state_layer_ids")}
        layer_config["architectures"] = ["LlamaForCausalLM"]
        name = verifier or getattr(target.config, "_name_or_path", None) or None
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer_config, "draft_vocab_size": model.draft_vocab_size,
                  "norm_before_residual": nbr, "target_hidden_size": h, "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": int(speculative_tokens)}],
                                         "default_proposal_method": "greedy",
                                         "verifier": {"name_or_path": name,
                                                      "architectures": list(getattr(target.config, "architectures",
                                                                                    None) or [])}},
                  "torch_dtype": dtype_name(model.dtype)}
    return config, {k: v.contiguous() for k, v in state.items()}


__all__ = ["LAYER_OVERRIDE_KEYS", "Refused", "UpstreamEagle3Model", "eagle3_aux_layers", "eagle3_from_upstream",
           "eagle3_to_upstream", "eagle_from_upstream", "eagle_to_upstream", "is_eagle1", "is_eagle3"]

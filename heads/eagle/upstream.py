"""EAGLE-1/2 checkpoints as other projects write and read them, converted to and from treespec's ``EagleModel``
(variant "upstream"). heads/checkpoints/detect.py reads the files and the kind (heads/eagle/kind.py) calls
``eagle_from_upstream``; heads/checkpoints/export.py calls ``eagle_to_upstream`` and writes the files.

**EAGLE-1/2** (SafeAILab/EAGLE ``cnets1.py``; branch v1 ``cnets.py``): keys unprefixed, ``fc.weight`` [H, 2H]
(+ ``fc.bias`` unless config ``"bias": false``; absent flag = true), ``layers.{i}.self_attn.{q,k,v,o}_proj``
(+ q/k/v biases when ``"qkv_bias": true``), ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.post_attention_layernorm`` and, for i >= 1 only, ``layers.{i}.input_layernorm``; optionally
``embed_tokens.weight`` (a copy of the target's table); no final norm, no lm_head. Forward, checked in
``Model.forward``: ``x = fc(torch.cat((inputs_embeds, hidden_states), dim=-1))`` — the token EMBEDDING
FIRST, the target feature second — then the layers (layer 0 without input norm), no final norm, and the
target's lm_head on the result. RoPE is the draft config's (``rope_theta``, 10000 when absent; linear or
dynamic ``rope_scaling``), head_dim = hidden / heads.
"""

from __future__ import annotations

import re

from treespec.heads.checkpoints.upstream_common import (
    Refused,
    base_config,
    bias_keys,
    check_vocab,
    layer_counts,
    layer_overrides,
    load_state,
    nonzero,
    own_embeddings,
    settle_biases,
    strip_model_prefix,
)
from treespec.heads.eagle.network import EagleModel, conform_linear_biases

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
    check_vocab(config, target, where)
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
    values = layer_counts(config, target, "layers.0.", weights, where)
    values["num_hidden_layers"] = len(layers)
    own = own_embeddings(weights, target, where)
    model = EagleModel(target, variant="upstream", layer_overrides=layer_overrides(target, values),
                       fc_bias="fc.bias" in weights, own_embeddings=own)
    state = {("decoder." + k if k.startswith("layers.") else k): v for k, v in weights.items()
             if k != "embed_tokens.weight" or own}
    conform_linear_biases(model, state)
    return load_state(model, state, where)


def _upstream_eagle_state(model: EagleModel) -> dict:
    """An upstream-variant EagleModel's tensors under upstream names (no embed_tokens unless its own)."""
    out = {}
    for key, value in model.state_dict().items():
        out[key.removeprefix("decoder.")] = value.detach().contiguous()
    return out




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
    config = base_config(model, target, {"sglang": "LlamaForCausalLMEagle", "vllm": "EagleLlamaForCausalLM",
                                          "eagle": "LlamaForCausalLM"}[consumer], c, model.dtype)
    qkv, o, mlp = r"^layers\.\d+\.self_attn\.[qkv]_proj$", r"^layers\.\d+\.self_attn\.o_proj$", r"^layers\.\d+\.mlp\."
    if consumer == "sglang":  # fc always has a bias; attention_bias (or bias) gives q, k, v AND o biases
        attention = nonzero(state, qkv.replace("$", r"\.bias$")) or nonzero(state, o.replace("$", r"\.bias$"))
        expected = {"fc.bias"} | (bias_keys(state, qkv) | bias_keys(state, o) if attention else set())
        state = settle_biases(state, expected, consumer, "SGLang's Llama layers have q/k/v/o biases together, "
                              "with config attention_bias, and no MLP biases")
        config.update({"attention_bias": attention})
    elif consumer == "vllm":  # fc has no bias; qkv_bias → q/k/v; attention_bias (or bias) → o_proj
        q_on, o_on = nonzero(state, qkv.replace("$", r"\.bias$")), nonzero(state, o.replace("$", r"\.bias$"))
        m_on = nonzero(state, mlp + r".*\.bias$")
        expected = (bias_keys(state, qkv) if q_on else set()) | (bias_keys(state, o) if o_on else set()) \
            | (bias_keys(state, mlp) if m_on else set())
        state = settle_biases(state, expected, consumer, "vLLM's EAGLE fc is built without a bias")
        config.update({"bias": False, "qkv_bias": q_on, "attention_bias": o_on, "mlp_bias": m_on})
    else:  # SafeAILab/EAGLE: fc bias per "bias", q/k/v per "qkv_bias", never o_proj or MLP biases
        if head_dim * c.num_attention_heads != c.hidden_size:
            raise Refused(f"SafeAILab/EAGLE uses head_dim = hidden / heads = {c.hidden_size // c.num_attention_heads}"
                          f", this drafter's is {head_dim}")
        kind = c.rope_parameters.get("rope_type", "default")
        if kind not in ("default", "linear", "dynamic"):
            raise Refused(f"SafeAILab/EAGLE supports linear and dynamic rope_scaling only, this drafter's is {kind!r}")
        q_on = nonzero(state, qkv.replace("$", r"\.bias$"))
        expected = ({"fc.bias"} if "fc.bias" in state else set()) | (bias_keys(state, qkv) if q_on else set())
        state = settle_biases(state, expected, consumer, "SafeAILab/EAGLE's layers have q/k/v biases at most")
        state.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.detach().to(model.dtype).cpu())
        config.update({"bias": "fc.bias" in state, "qkv_bias": q_on, "pretraining_tp": 1})
        if config["rope_scaling"]:
            config["rope_scaling"] = {"type": kind, "factor": c.rope_parameters.get("factor", 1.0)}
    config["num_hidden_layers"] = n
    return config, {k: v.contiguous() for k, v in state.items()}



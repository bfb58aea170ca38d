"""Exporting drafters to each consumer's layout (heads/checkpoints/export.py; the loading side:
tests/heads/test_interop_load.py; what an export refuses: tests/heads/test_export_refusals.py).

Exports are loaded back (identical proposals) and checked against each consumer's loading rules, written down
below as data from the consumer's source (vLLM, SGLang, speculators, SafeAILab's EAGLE, FasterDecoding's
Medusa); loaded upstream checkpoints (tests/helpers/upstream_checkpoints.py) re-export to every consumer that can
hold them.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treespec.heads import load, registry
from treespec.heads.checkpoints.export import MANIFEST, export
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map

from tests.helpers import fresh_drafter, interop_targets, proposals_of, synthesise, tiny_qwen3


@pytest.fixture(scope="module")
def targets():
    return interop_targets()



# -- what each consumer loads, from its source (the rules exports are checked against) ----------------------------
def _layer_params(p, c, in_width, h, qkv_bias, o_bias, mlp_bias, input_norm=True, hidden_norm=False):
    d = c.get("head_dim") or h // c["num_attention_heads"]
    nh, nkv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    out = {p + "self_attn.q_proj.weight": (nh * d, in_width), p + "self_attn.k_proj.weight": (nkv * d, in_width),
           p + "self_attn.v_proj.weight": (nkv * d, in_width), p + "self_attn.o_proj.weight": (h, nh * d),
           p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
           p + "mlp.down_proj.weight": (h, inter), p + "post_attention_layernorm.weight": (h,)}
    if qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (nh * d,), p + "self_attn.k_proj.bias": (nkv * d,),
                    p + "self_attn.v_proj.bias": (nkv * d,)})
    if o_bias:
        out[p + "self_attn.o_proj.bias"] = (h,)
    if mlp_bias:
        out.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                    p + "mlp.down_proj.bias": (h,)})
    if input_norm:
        out[p + "input_layernorm.weight"] = (h,)
    if hidden_norm:
        out[p + "hidden_norm.weight"] = (h,)
    return out


def sglang_eagle_params(c):
    """sglang/srt/models/llama_eagle.py: LlamaModel.fc = Linear(2H, H) (bias always); layers from
    models/llama.py with attention_bias = config.attention_bias or config.bias for q/k/v AND o_proj, no MLP
    bias; layer 0's input_layernorm deleted (identity). embed_tokens / lm_head come from the target."""
    h, ab = c["hidden_size"], bool(c.get("attention_bias") or c.get("bias"))
    params = {"model.fc.weight": (h, 2 * h), "model.fc.bias": (h,)}
    for i in range(c["num_hidden_layers"]):
        params.update(_layer_params(f"model.layers.{i}.", c, h, h, ab, ab, False, input_norm=i > 0))
    return params


def vllm_eagle_params(c):
    """vllm/model_executor/models/llama_eagle.py: fc = Linear(2H, H, bias=False); LlamaDecoderLayer from
    llama.py: attention_bias = attention_bias or bias → o_proj, qkv_bias (if present) overrides q/k/v; MLP bias
    = mlp_bias; layer 0 input_layernorm = Identity; embed_tokens skipped (shared with the target)."""
    h = c["hidden_size"]
    ab = bool(c.get("attention_bias") or c.get("bias"))
    qkv = bool(c["qkv_bias"]) if "qkv_bias" in c else ab
    params = {"model.fc.weight": (h, 2 * h)}
    for i in range(c["num_hidden_layers"]):
        params.update(_layer_params(f"model.layers.{i}.", c, h, h, qkv, ab, bool(c.get("mlp_bias")), input_norm=i > 0))
    return params


def official_eagle_params(c):
    """SafeAILab/EAGLE cnets1.py Model (v1 loads it strict): embed_tokens, fc (bias per config "bias", default
    true), LlamaAttention q/k/v bias per qkv_bias, o_proj and MLP without bias, no layer-0 input norm."""
    h = c["hidden_size"]
    params = {"embed_tokens.weight": (c["vocab_size"], h), "fc.weight": (h, 2 * h)}
    if c.get("bias", True):
        params["fc.bias"] = (h,)
    for i in range(c["num_hidden_layers"]):
        params.update(_layer_params(f"layers.{i}.", c, h, h, bool(c.get("qkv_bias")), False, False, input_norm=i > 0))
    return params


def sglang_eagle3_params(c):
    """sglang/srt/models/llama_eagle3.py: fc = Linear(3·Ht, H, bias=config.bias); midlayer q/k/v over 2H WITHOUT
    bias, o_proj bias = attention_bias or bias (llama.py); hidden_norm; norm; lm_head [draft_vocab, H];
    d2t → hot_token_id; t2d skipped; embed_tokens from the target; keys it does not know are ignored."""
    h, ht = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    params = {"model.fc.weight": (h, 3 * ht), "model.norm.weight": (h,), "lm_head.weight": (c["draft_vocab_size"], h)}
    if c["draft_vocab_size"] < c["vocab_size"]:  # hot_token_id = d2t + arange; without it, the full vocabulary
        params["d2t"] = (c["draft_vocab_size"],)
    if c.get("bias"):
        params["model.fc.bias"] = (h,)
    params.update(_layer_params("model.midlayer.", c, 2 * h, h, False, bool(c.get("attention_bias") or c.get("bias")),
                                False, hidden_norm=True))
    return params


def vllm_eagle3_params(c):
    """vllm/model_executor/models/llama_eagle3.py: fc = ReplicatedLinear(3·Ht, H, bias=False); layers.0 with q/k/v
    over 2H, qkv bias = attention_bias, o_proj bias = attention_bias or bias, MLP bias = mlp_bias, hidden_norm;
    norm; lm_head [draft_vocab, H]; d2t → draft_id_to_target_id; t2d ignored; embed_tokens optional."""
    h, ht = c["hidden_size"], c.get("target_hidden_size") or c["hidden_size"]
    params = {"model.fc.weight": (h, 3 * ht), "model.norm.weight": (h,), "lm_head.weight": (c["draft_vocab_size"], h),
              "draft_id_to_target_id": (c["draft_vocab_size"],), "model.embed_tokens.weight": (c["vocab_size"], h)}
    # embed_tokens: loaded when present, else the target's (load_weights skip_substrs)
    params.update(_layer_params("model.layers.0.", c, 2 * h, h, bool(c.get("attention_bias")),
                                bool(c.get("attention_bias") or c.get("bias")), bool(c.get("mlp_bias")),
                                hidden_norm=True))
    return params


def speculators_params(c):
    """vLLM reads a speculators folder by merging transformer_layer_config with the top-level fields
    (transformers_utils/configs/speculators/algos.py update_eagle3), then loads it as Eagle3LlamaForCausalLM."""
    return vllm_eagle3_params({**c["transformer_layer_config"], **{k: v for k, v in c.items()
                                                                   if k != "transformer_layer_config"}})


def official_eagle3_params(c):
    """SafeAILab/EAGLE cnets.py Model: fc [H, 3·Ht] no bias; midlayer (LlamaDecoderLayeremb) without biases;
    norm; lm_head [draft_vocab, H]; buffers d2t [draft_vocab] int64, t2d [V] bool; embed_tokens from the base."""
    h, ht = c["hidden_size"], c.get("target_hidden_size", c["hidden_size"])
    params = {"fc.weight": (h, 3 * ht), "norm.weight": (h,), "lm_head.weight": (c["draft_vocab_size"], h),
              "d2t": (c["draft_vocab_size"],), "t2d": (c["vocab_size"],), "embed_tokens.weight": (c["vocab_size"], h)}
    params.update(_layer_params("midlayer.", c, 2 * h, h, False, False, False, hidden_norm=True))
    return params


def vllm_medusa_params(c):
    """vllm/model_executor/models/medusa.py: blocks.{h}.layers.{l} = Linear(H, H, bias=medusa_fc_bias);
    lm_heads.{h} [truncated_vocab, H], or one lm_head with original_lm_head."""
    h, v = c["hidden_size"], c["truncated_vocab_size"]
    params = {}
    for k in range(c["num_heads"]):
        for j in range(c["num_hidden_layers"]):
            params[f"blocks.{k}.layers.{j}.weight"] = (h, h)
            if c.get("medusa_fc_bias"):
                params[f"blocks.{k}.layers.{j}.bias"] = (h,)
        if not c.get("original_lm_head"):
            params[f"lm_heads.{k}.weight"] = (v, h)
    if c.get("original_lm_head"):
        params["lm_head.weight"] = (v, h)
    return params


def official_medusa_params(c):
    """FasterDecoding/Medusa medusa_model.py: medusa_head[h] = Sequential(ResBlock × L (one object), Linear(H, V,
    bias=False)); ResBlock.linear = Linear(H, H) with bias."""
    params = {}
    for k in range(c["medusa_num_heads"]):
        for j in range(c["medusa_num_layers"]):
            params.update({f"{k}.{j}.linear.weight": (c["hidden_size"], c["hidden_size"]),
                           f"{k}.{j}.linear.bias": (c["hidden_size"],)})
        params[f"{k}.{c['medusa_num_layers']}.weight"] = (c["vocab_size"], c["hidden_size"])
    return params


def _prefix_model(key):
    return key if key.startswith("lm_head") else "model." + key


def _vllm_eagle3_name(key):
    key = key.replace("midlayer.", "layers.0.")
    if key == "t2d":
        return None
    if key == "d2t":
        return "draft_id_to_target_id"
    return _prefix_model(key)


def _sglang_eagle3_name(key):
    if key == "t2d":
        return None
    return key if key in ("lm_head.weight", "d2t") else "model." + key


def FULL_VOCAB_OPTIONAL(c):  # noqa: N802 — vLLM keeps draft_id_to_target_id at zeros (the identity) when absent
    return {"draft_id_to_target_id"} if c["draft_vocab_size"] == c.get("transformer_layer_config", c)["vocab_size"] \
        else set()


# consumer → kind → its rules: weight file, architectures, the params its loader builds from the config (name →
# shape, after its renames), which may stay absent (filled from the target), which keys it drops, how its aux ids
# map onto treespec's hidden_states indices, and config fields it needs with their required values.
RULES = {
    ("sglang", "eagle"): dict(file="model.safetensors", arch=["LlamaForCausalLMEagle"], params=sglang_eagle_params,
                              rename=_prefix_model, optional=set(), fields={"tie_word_embeddings": False}),
    ("vllm", "eagle"): dict(file="model.safetensors", arch=["EagleLlamaForCausalLM"], params=vllm_eagle_params,
                            rename=_prefix_model, optional=set(), fields={"bias": False}),
    ("eagle", "eagle"): dict(file="pytorch_model.bin", arch=["LlamaForCausalLM"], params=official_eagle_params,
                             rename=lambda k: k, optional=set(), fields={"pretraining_tp": 1}),
    ("sglang", "eagle3"): dict(file="model.safetensors", arch=["LlamaForCausalLMEagle3"], params=sglang_eagle3_params,
                               rename=_sglang_eagle3_name, optional=set(), fields={"tie_word_embeddings": False},
                               aux=lambda c: [i + 1 for i in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]),
    ("vllm", "eagle3"): dict(file="model.safetensors", arch=["Eagle3LlamaForCausalLM"], params=vllm_eagle3_params,
                             rename=_vllm_eagle3_name, optional=FULL_VOCAB_OPTIONAL,
                             fields={"bias": False}, aux=lambda c: c["eagle_aux_hidden_state_layer_ids"]),
    ("speculators", "eagle3"): dict(file="model.safetensors", arch=["Eagle3Speculator"], params=speculators_params,
                                    rename=_vllm_eagle3_name,
                                    optional=FULL_VOCAB_OPTIONAL,
                                    fields={"speculators_model_type": "eagle3"},
                                    aux=lambda c: c["eagle_aux_hidden_state_layer_ids"]),
    ("eagle", "eagle3"): dict(file="model.safetensors", arch=["LlamaForCausalLM"], params=official_eagle3_params,
                              rename=lambda k: k, optional={"embed_tokens.weight"}, fields={},
                              aux=lambda c: None),
    ("vllm", "medusa"): dict(file="model.safetensors", arch=["MedusaModel"], params=vllm_medusa_params,
                             rename=lambda k: k, optional=set(), fields={"model_type": "medusa"}),
    ("medusa", "medusa"): dict(file="medusa_lm_head.pt", arch=None, params=official_medusa_params,
                               rename=lambda k: k, optional=set(), fields={}),
}


def check_consumer(folder: Path, consumer: str, kind: str, module, target):
    """The folder against ``RULES[(consumer, kind)]``: exactly the consumer's files, architecture and fields;
    every tensor lands on a parameter the consumer builds, with its shape and dtype; every parameter it needs is
    provided; aux ids in its convention name the module's hidden states; RoPE and positions mirrored."""
    rule = RULES[(consumer, kind)]
    # what the consumer reads, and the export's hidden manifest of its own files (heads/checkpoints/export.py)
    assert sorted(p.name for p in folder.iterdir() if p.name != MANIFEST) == sorted(["config.json", rule["file"]])
    assert json.loads((folder / MANIFEST).read_text())["files"] == sorted(["config.json", rule["file"], MANIFEST])
    config = json.loads((folder / "config.json").read_text())
    path = folder / rule["file"]
    tensors = load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    if rule["arch"] is not None:
        assert config["architectures"] == rule["arch"]
    for key, value in rule["fields"].items():
        assert config[key] == value, key
    params = rule["params"](config)
    landed = {}
    for key, tensor in tensors.items():
        name = rule["rename"](key)
        if name is None:
            continue
        assert name in params, f"{consumer} has no parameter for {key!r} (→ {name!r})"
        assert tuple(tensor.shape) == tuple(params[name]), (key, tuple(tensor.shape), params[name])
        landed[name] = tensor
    optional = rule["optional"](config) if callable(rule["optional"]) else rule["optional"]
    absent = set(params) - set(landed) - optional
    if consumer in ("sglang", "vllm", "speculators"):  # embed_tokens and (EAGLE-1) lm_head come from the target
        absent -= {k for k in absent if "embed_tokens" in k}
    assert not absent, f"{consumer} would leave {sorted(absent)} uninitialised"
    dtype = next(p for p in module.parameters()).dtype
    for key, tensor in tensors.items():
        if key in ("d2t", "draft_id_to_target_id"):
            assert tensor.dtype == torch.int64
        elif key == "t2d":
            assert tensor.dtype == torch.bool
        else:
            assert tensor.dtype == dtype, key
    if "aux" in rule and rule["aux"](config) is not None:
        assert tuple(rule["aux"](config)) == tuple(module.aux_layers)
    layer = config.get("transformer_layer_config", config)
    if kind != "medusa":
        params_rope = layer["rope_parameters"]
        assert layer["rope_theta"] == params_rope["rope_theta"] == module.layer_config.rope_parameters["rope_theta"]
        assert layer["max_position_embeddings"] >= target.config.max_position_embeddings
        assert layer["hidden_act"] == "silu" and layer["num_hidden_layers"] >= 1
    return config, tensors



# -- export → load round trips ----------------------------------------------------------------------------------
EXPORTS = [("eagle", "sglang"), ("eagle", "vllm"), ("eagle", "eagle"), ("eagle3", "sglang"), ("eagle3", "vllm"),
           ("eagle3", "speculators"), ("eagle3", "eagle"), ("medusa", "vllm"), ("medusa", "medusa")]


@pytest.mark.parametrize("kind, consumer", EXPORTS, ids=[f"{k}-{c}" for k, c in EXPORTS])
def test_export_follows_the_consumer_and_loads_back_identically(kind, consumer, tmp_path, targets):
    target = targets["llama"]
    model = fresh_drafter(kind, target)
    if kind == "eagle" and consumer == "vllm":  # vLLM's EAGLE fc has no bias (a nonzero one is refused below)
        with torch.no_grad():
            model.fc.bias.zero_()
    if kind == "eagle3" and consumer == "eagle":  # the official code hard-codes aux layers (2, L//2, L-3)
        model = Eagle3Model(target, aux_layers=(2, 2, 1), vocab_map=(model.d2t, model.t2d)).eval()
    folder = export(model, target, tmp_path / "out", to=consumer, verifier="tiny/llama")
    check_consumer(folder, consumer, kind, model, target)
    back = load(folder, target)
    assert proposals_of(back, target) == proposals_of(registry.AUTO.make(model), target)


@pytest.mark.parametrize("name", ["eagle1-qkvbias-qwen2", "eagle3-specforge-qwen2", "eagle3-speculators-llama",
                                  "medusa-v2-qwen2"])
def test_upstream_checkpoints_re_export(name, tmp_path, targets):
    """Loaded upstream drafters (Qwen2 q/k/v biases, own embeddings, norm_before_residual, a shared lm_head)
    export to every consumer that can hold them, load back identically, and are refused by the others."""
    target, folder, _, fmt = synthesise(name, tmp_path, targets)
    module = registry.AUTO.load(folder, target)
    reference = proposals_of(registry.AUTO.make(module), target)
    done = []
    for kind, consumer in EXPORTS:
        if kind != {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa"}[fmt]:
            continue
        try:
            out = export(module, target, tmp_path / f"out-{consumer}", to=consumer)
        except Refused as err:
            done.append((consumer, "refused", str(err)))
            continue
        check_consumer(out, consumer, kind, module, target)
        assert proposals_of(load(out, target), target) == reference, consumer
        done.append((consumer, "ok", ""))
    status = {c: s for c, s, _ in done}
    expected = {"eagle1-qkvbias-qwen2": {"sglang": "ok", "vllm": "ok", "eagle": "ok"},
                "eagle3-specforge-qwen2": {"sglang": "ok", "vllm": "ok", "speculators": "ok", "eagle": "refused"},
                "eagle3-speculators-llama": {"sglang": "refused", "vllm": "ok", "speculators": "ok",
                                             "eagle": "refused"},
                "medusa-v2-qwen2": {"vllm": "ok", "medusa": "ok"}}[name]
    assert status == expected, done


# -- exports as their consumers load them ------------------------------------------------------------------------------
def test_a_qwen3_head_exports_to_every_serving_stack(tmp_path):
    """The EAGLE-3 layer is Llama-style by default whatever the target, so a head for a Qwen3 target exports to
    vLLM, SGLang and speculators and loads back identically; the target's own classes (q/k norms) stay an
    option that only treespec loads, refused with the way out."""
    from treespec.heads.checkpoints.export import formats

    qwen3 = tiny_qwen3()
    torch.manual_seed(0)
    model = Eagle3Model(qwen3, vocab_map=build_vocab_map(torch.randint(0, 100, (64,)), 24)).eval()
    assert not any("q_norm" in k for k in model.state_dict())
    reference = proposals_of(registry.AUTO.make(model), qwen3)
    for consumer in ("vllm", "sglang", "speculators"):
        folder = export(model, qwen3, tmp_path / consumer, to=consumer, verifier="tiny/qwen3")
        check_consumer(folder, consumer, "eagle3", model, qwen3)
        assert proposals_of(load(folder, qwen3), qwen3) == reference, consumer
    own = Eagle3Model(qwen3, layer="target")
    with pytest.raises(Refused, match=r"q/k norms .* layer='llama' \(the default\) exports"):
        export(own, qwen3, tmp_path / "own", to="vllm")
    reach = formats(own, qwen3, before_training=True)
    assert all("q/k norms" in reach[c] for c in ("vllm", "sglang", "speculators"))
    assert {c for c, why in formats(model, qwen3).items() if why is None} >= {"vllm", "sglang", "speculators"}


def test_speculators_export_carries_the_targets_token_table(tmp_path, targets):
    """speculators' loader builds embed_tokens and leaves it all zeros when the file lacks it: the export carries
    the target's table (treespec reads it back as the target's, not a table of the drafter's own)."""
    llama = targets["llama"]
    model = fresh_drafter("eagle3", llama)
    folder = export(model, llama, tmp_path / "spec", to="speculators", verifier="tiny/llama")
    table = load_file(folder / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(table, llama.get_input_embeddings().weight.detach())
    assert getattr(load(folder, llama).model, "embed_tokens", None) is None

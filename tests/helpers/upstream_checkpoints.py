"""Upstream drafter checkpoints synthesised for the interop tests (tests/heads/test_interop_load.py,
tests/heads/test_interop_export.py), each with the reference forward it is checked against
(tests/helpers/upstream_reference.py).

Nothing is downloaded: every upstream checkpoint is synthesised here with the exact key names and config
fields its project writes (EAGLE-1/2 as SafeAILab publishes it, EAGLE-3 as SafeAILab, SpecForge/SGLang,
vLLM and speculators write it, Medusa-1, Medusa "v2", Medusa-2 and vLLM's Medusa), for tiny random Llama
and Qwen2 targets. ``synthesise(name, ...)`` writes one of ``UPSTREAM_CASES``.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map
from treespec.heads.medusa import MedusaHeads

from .upstream_reference import eagle1_reference, eagle3_reference, medusa_reference


# -- synthesised upstream checkpoints ------------------------------------------------------------------------
def rnd(g, *shape, scale=0.15):
    return torch.randn(*shape, generator=g) * scale


def norm_w(g, n):
    return 1.0 + 0.1 * torch.randn(n, generator=g)


def decoder_layer(g, p, h, heads, kv, d, inter, in_width, qkv_bias=False, input_norm=True, hidden_norm=False):
    t = {p + "self_attn.q_proj.weight": rnd(g, heads * d, in_width),
         p + "self_attn.k_proj.weight": rnd(g, kv * d, in_width),
         p + "self_attn.v_proj.weight": rnd(g, kv * d, in_width),
         p + "self_attn.o_proj.weight": rnd(g, h, heads * d),
         p + "mlp.gate_proj.weight": rnd(g, inter, h), p + "mlp.up_proj.weight": rnd(g, inter, h),
         p + "mlp.down_proj.weight": rnd(g, h, inter), p + "post_attention_layernorm.weight": norm_w(g, h)}
    if qkv_bias:
        t.update({p + f"self_attn.{x}_proj.bias": rnd(g, t[p + f"self_attn.{x}_proj.weight"].shape[0]) for x in "qkv"})
    if input_norm:
        t[p + "input_layernorm.weight"] = norm_w(g, h)
    if hidden_norm:
        t[p + "hidden_norm.weight"] = norm_w(g, h)
    return t


def write_checkpoint(folder: Path, config: dict | None, tensors: dict, filename: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    if filename.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / filename))
    else:
        torch.save(tensors, folder / filename)
    return folder


def eagle1_official(tmp, target, g):
    """SafeAILab/EAGLE EAGLE-1 as published: pytorch_model.bin with embed_tokens, fc bias (no "bias" flag),
    two layers (the second with its input norm), the draft's own rms_norm_eps (0.05, large enough to matter;
    the target's is 1e-6)."""
    h, v = 32, 64
    t = {"fc.weight": rnd(g, h, 2 * h), "fc.bias": rnd(g, h),
         "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone()}
    for i in range(2):
        t.update(decoder_layer(g, f"layers.{i}.", h, 2, 2, 16, 64, h, input_norm=i > 0))
    c = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
         "hidden_size": h, "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 2048,
         "model_type": "llama", "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 2,
         "pad_token_id": 0, "pretraining_tp": 1, "rms_norm_eps": 0.05, "rope_scaling": None,
         "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
         "vocab_size": v}
    return write_checkpoint(tmp, c, t, "pytorch_model.bin"), eagle1_reference(t, c, target), "eagle"


def eagle1_qwen(tmp, target, g):
    """An EAGLE-1 draft for a Qwen2 target: model.safetensors, "bias": false, "qkv_bias": true, GQA, no
    embed_tokens (the target's table), no rope_theta (10000, where the target's is 1e6)."""
    h = 32
    t = {"fc.weight": rnd(g, h, 2 * h), **decoder_layer(g, "layers.0.", h, 4, 2, 8, 48, h, qkv_bias=True,
                                                          input_norm=False)}
    c = {"architectures": ["Qwen2ForCausalLM"], "bias": False, "qkv_bias": True, "hidden_size": h,
         "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "model_type": "qwen2", "vocab_size": 64, "torch_dtype": "float32"}
    return write_checkpoint(tmp, c, t, "model.safetensors"), eagle1_reference(t, c, target), "eagle"


def eagle3_layer(g, h, heads, kv, d, inter, prefix="midlayer."):
    return decoder_layer(g, prefix, h, heads, kv, d, inter, 2 * h, hidden_norm=True)


def eagle3_vocab(g, draft_vocab, vocab=64):
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (vocab,), generator=g), draft_vocab)
    return d2t, t2d


def eagle3_official(tmp, target, g):
    """SafeAILab/EAGLE EAGLE-3: midlayer.*, d2t/t2d for a 40-token draft vocabulary, no embed_tokens, no aux
    ids in the config (the published (2, L//2, L-3) = (2, 2, 1) for this 4-layer target), no rope_theta."""
    h = 32
    d2t, t2d = eagle3_vocab(g, 40)
    t = {"fc.weight": rnd(g, h, 3 * h), **eagle3_layer(g, h, 2, 2, 16, 64), "norm.weight": norm_w(g, h),
         "lm_head.weight": rnd(g, 40, h, scale=0.5), "d2t": d2t, "t2d": t2d}
    c = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
         "hidden_size": h, "intermediate_size": 64, "max_position_embeddings": 2048, "model_type": "llama",
         "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0,
         "rms_norm_eps": 0.05, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 64,
         "draft_vocab_size": 40}
    return write_checkpoint(tmp, c, t, "model.safetensors"), eagle3_reference(t, c, target, (2, 2, 1)), "eagle3"


def eagle3_specforge(tmp, target, g):
    """SpecForge / SGLang export for a Qwen2 target: a ``model.`` prefix, nested eagle_config aux ids in the
    output-of-layer convention ([0, 1, 2] = hidden_states 1, 2, 3), rope_theta absent (10000; the target: 1e6)."""
    h = 32
    d2t, t2d = eagle3_vocab(g, 48)
    t = {"fc.weight": rnd(g, h, 3 * h), **eagle3_layer(g, h, 4, 2, 8, 64), "norm.weight": norm_w(g, h),
         "lm_head.weight": rnd(g, 48, h, scale=0.5), "d2t": d2t, "t2d": t2d}
    c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
         "hidden_act": "silu", "vocab_size": 64, "draft_vocab_size": 48, "target_hidden_size": h,
         "max_position_embeddings": 256, "tie_word_embeddings": False,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    stored = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in t.items()}
    return write_checkpoint(tmp, c, stored, "model.safetensors"), eagle3_reference(t, c, target, (1, 2, 3)), "eagle3"


def speculators_config(c_layer, draft_vocab, aux, nbr, h=32):
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "speculators_version": "0.3.0",
            "transformer_layer_config": c_layer, "draft_vocab_size": draft_vocab, "norm_before_residual": nbr,
            "target_hidden_size": h, "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]}}}


def eagle3_speculators(tmp, target, g):
    """speculators: layers.0.*, transformer_layer_config, top-level aux ids (input of layer i, in the order
    fc reads them: [1, 3, 2]), norm_before_residual true, its own embed_tokens, one KV head, rope_theta 5000."""
    h = 32
    d2t, t2d = eagle3_vocab(g, 32)
    t = {"fc.weight": rnd(g, h, 3 * h), **eagle3_layer(g, h, 2, 1, 16, 64, prefix="layers.0."),
         "norm.weight": norm_w(g, h), "lm_head.weight": rnd(g, 32, h, scale=0.5), "d2t": d2t, "t2d": t2d,
         "embed_tokens.weight": rnd(g, 64, h, scale=1.0)}
    c_layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": 64,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 1,
               "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": 64, "rope_theta": 5000.0,
               "max_position_embeddings": 256, "attention_bias": False, "mlp_bias": False}
    c = speculators_config(c_layer, 32, [1, 3, 2], True)
    ref = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    return (write_checkpoint(tmp, c, t, "model.safetensors"), eagle3_reference(ref, c_layer, target, (1, 3, 2), True),
            "eagle3")


def eagle3_vllm_full(tmp, target, g):
    """vLLM's own EAGLE-3 layout for the full vocabulary: layers.0.*, no d2t/t2d, top-level aux ids."""
    h = 32
    t = {"fc.weight": rnd(g, h, 3 * h), **eagle3_layer(g, h, 2, 2, 16, 64, prefix="layers.0."),
         "norm.weight": norm_w(g, h), "lm_head.weight": rnd(g, 64, h, scale=0.5)}
    c = {"architectures": ["Eagle3LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
         "hidden_act": "silu", "vocab_size": 64, "draft_vocab_size": 64, "rope_theta": 10000.0,
         "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    ref = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    return write_checkpoint(tmp, c, t, "model.safetensors"), eagle3_reference(ref, c, target, (1, 2, 3)), "eagle3"


def medusa1(tmp, target, g):
    """FasterDecoding/Medusa-1: medusa_lm_head.pt, 3 heads of one ResBlock + own lm_head; its config says 5
    heads (published configs do not always match the file: the keys decide)."""
    h, v = 32, 64
    t, blocks, lms = {}, {}, {}
    for k in range(3):
        w, b, lm = rnd(g, h, h, scale=0.3), rnd(g, h), rnd(g, v, h, scale=0.5)
        t.update({f"{k}.0.linear.weight": w, f"{k}.0.linear.bias": b, f"{k}.1.weight": lm})
        blocks[k], lms[k] = [(w, b)], lm
    c = {"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
         "transformers_version": "4.33.0"}
    return write_checkpoint(tmp, c, t, "medusa_lm_head.pt"), medusa_reference(blocks, lms, target), "medusa"


def medusa_v2(tmp, target, g):
    """Medusa "v2" (TGI): medusa_lm_head.safetensors with residual blocks only; the target's lm_head."""
    h = 32
    t, blocks = {}, {}
    for k in range(3):
        w, b = rnd(g, h, h, scale=0.3), rnd(g, h)
        t.update({f"{k}.0.linear.weight": w, f"{k}.0.linear.bias": b})
        blocks[k] = [(w, b)]
    c = {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny/qwen2"}
    return (write_checkpoint(tmp, c, t, "medusa_lm_head.safetensors"),
            medusa_reference(blocks, {k: None for k in range(3)}, target), "medusa")


def medusa_vllm(tmp, target, g):
    """vLLM's MedusaModel: blocks.{h}.layers.{l}.weight (two untied layers, no bias: medusa_fc_bias false),
    lm_heads.{h}.weight; num_heads in its config."""
    h, v = 32, 64
    t, blocks, lms = {}, {}, {}
    for k in range(2):
        blocks[k] = [(rnd(g, h, h, scale=0.3), None) for _ in range(2)]
        lms[k] = rnd(g, v, h, scale=0.5)
        t.update({f"blocks.{k}.layers.{j}.weight": w for j, (w, _) in enumerate(blocks[k])})
        t[f"lm_heads.{k}.weight"] = lms[k]
    c = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": h, "vocab_size": v, "num_heads": 2,
         "num_hidden_layers": 2, "truncated_vocab_size": v, "medusa_fc_bias": False}
    return write_checkpoint(tmp, c, t, "model.safetensors"), medusa_reference(blocks, lms, target), "medusa"


def medusa2(tmp, target, g):
    """Medusa-2: a full model folder, medusa_head.{h}.{j}.* beside the base weights (which are ignored)."""
    h, v = 32, 64
    t, blocks, lms = {"model.embed_tokens.weight": rnd(g, v, h), "lm_head.weight": rnd(g, v, h)}, {}, {}
    for k in range(2):
        w, b, lm = rnd(g, h, h, scale=0.3), rnd(g, h), rnd(g, v, h, scale=0.5)
        t.update({f"medusa_head.{k}.0.linear.weight": w, f"medusa_head.{k}.0.linear.bias": b,
                  f"medusa_head.{k}.1.weight": lm})
        blocks[k], lms[k] = [(w, b)], lm
    c = {"architectures": ["MedusaModel"], "medusa_num_heads": 2, "medusa_num_layers": 1, "model_type": "llama"}
    return write_checkpoint(tmp, c, t, "model.safetensors"), medusa_reference(blocks, lms, target), "medusa"


UPSTREAM_CASES = {  # name → (synthesiser, target, expected module type)
    "eagle1-official-llama": (eagle1_official, "llama", EagleModel),
    "eagle1-qkvbias-qwen2": (eagle1_qwen, "qwen2", EagleModel),
    "eagle3-official-llama": (eagle3_official, "llama", Eagle3Model),
    "eagle3-specforge-qwen2": (eagle3_specforge, "qwen2", Eagle3Model),
    "eagle3-speculators-llama": (eagle3_speculators, "llama", Eagle3Model),
    "eagle3-vllm-fullvocab-qwen2": (eagle3_vllm_full, "qwen2", Eagle3Model),
    "medusa1-llama": (medusa1, "llama", MedusaHeads),
    "medusa-v2-qwen2": (medusa_v2, "qwen2", MedusaHeads),
    "medusa-vllm-llama": (medusa_vllm, "llama", MedusaHeads),
    "medusa2-qwen2": (medusa2, "qwen2", MedusaHeads),
}


def synthesise(name, tmp_path, targets):
    make, target_name, _ = UPSTREAM_CASES[name]
    target = targets[target_name]
    folder, reference, fmt = make(tmp_path / name, target, torch.Generator().manual_seed(len(name)))
    return target, folder, reference, fmt

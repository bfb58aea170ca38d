"""Checkpoint interop (heads/load.py, heads/export.py, heads/eagle/upstream.py, heads/medusa/upstream.py).

Nothing is downloaded: every upstream checkpoint is synthesised here with the exact key names and config
fields its project writes (EAGLE-1/2 as SafeAILab publishes it, EAGLE-3 as SafeAILab, SpecForge/SGLang,
vLLM and speculators write it, Medusa-1, Medusa "v2", Medusa-2 and vLLM's Medusa), for tiny random Llama
and Qwen2 targets. Each loaded drafter is checked against a reference forward written below from the
published equations (plain tensor ops, no transformers or treespec modules): its logits, the tokens of every
proposal (rank r = the reference's r-th likeliest token) and, sampling, its q_draft; greedy generation must
equal vanilla, and two formats pass a chi-square test of the sampled distribution. Exports are loaded back
(identical proposals) and checked against each consumer's loading rules, written down below as data from
the consumer's source. Corrupt, truncated, mismatched and unknown checkpoints each get their error.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import detect as detect_module
from treespec.heads import export, load, registry
from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map
from treespec.heads.medusa import MedusaHeads
from treespec.heads.upstream_common import Refused
from treespec.sampling import Sampling, probs

from .helpers import VOCAB, chi2_pvalue, exact_distribution, hf_greedy, sampled_counts, tiny_llama


# -- targets ------------------------------------------------------------------------------------------------
def tiny_qwen2(vocab=64, layers=4, seed=0, rope_theta=1e6):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, initializer_range=0.2,
                         attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen2ForCausalLM(config).eval()


TARGETS = {"llama": lambda: tiny_llama(layers=4, seed=0), "qwen2": lambda: tiny_qwen2()}


@pytest.fixture(scope="module")
def targets():
    return {name: make() for name, make in TARGETS.items()}


PROMPT = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


# -- the published equations, written out (no transformers or treespec modules) ------------------------------
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """x [heads, n, d] at positions 0..n-1, rotate-half convention (Llama / EAGLE)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def lin(x, t, name):
    y = x @ t[f"{name}.weight"].T
    return y + t[f"{name}.bias"] if f"{name}.bias" in t else y


def attention(x, t, p, heads, kv_heads, d, theta):
    """Causal GQA self-attention over x [n, in] with RoPE; weights ``{p}self_attn.{q,k,v,o}_proj``."""
    n = x.shape[0]
    q = rope(lin(x, t, p + "self_attn.q_proj").view(n, heads, d).transpose(0, 1), theta)
    k = rope(lin(x, t, p + "self_attn.k_proj").view(n, kv_heads, d).transpose(0, 1), theta)
    v = lin(x, t, p + "self_attn.v_proj").view(n, kv_heads, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((n, n), float("-inf")).triu(1)
    return lin((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d), t, p + "self_attn.o_proj")


def mlp(x, t, p):
    return lin(F.silu(lin(x, t, p + "mlp.gate_proj")) * lin(x, t, p + "mlp.up_proj"), t, p + "mlp.down_proj")


def target_states(target, ids):
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True).hidden_states  # L + 1 × [1, n, H]


def eagle1_reference(t, c, target):
    """EAGLE-1/2 (cnets1.py): x = fc(cat(embed(token), feature)); layer 0 without input norm; no final norm;
    the target's lm_head. ``logits_at(committed, path)`` → the draft logits after ``path`` (tree tokens)."""
    heads, eps, theta = c["num_attention_heads"], c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
    h = t["fc.weight"].shape[0]
    d, kv = h // heads, t["layers.0.self_attn.k_proj.weight"].shape[0] // (h // heads)
    embed = t.get("embed_tokens.weight", target.get_input_embeddings().weight)
    head = target.get_output_embeddings().weight
    layers = len({k.split(".")[1] for k in t if k.startswith("layers.")})

    def forward(tokens, feats):
        x = lin(torch.cat([embed[tokens], feats], -1), t, "fc")
        for i in range(layers):
            p = f"layers.{i}."
            y = x if i == 0 else rms(x, t[p + "input_layernorm.weight"], eps)
            x = x + attention(y, t, p, heads, kv, d, theta)
            x = x + mlp(rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p)
        return x  # [n, H]: predicted features

    def logits_at(committed, path):
        with torch.no_grad():
            feats = target_states(target, committed[:, :-1])[-1][0]  # final-norm features of positions 0..L-2
            tokens = committed[0, 1:].tolist()
            for token in path:  # a tree node pairs its token with its parent's output
                out = forward(torch.tensor(tokens), feats)
                tokens, feats = tokens + [token], torch.cat([feats, out[-1:]])
            return forward(torch.tensor(tokens), feats)[-1] @ head.T

    return logits_at


def eagle3_reference(t, c, target, aux, norm_before_residual=False):
    """EAGLE-3 (cnets.py LlamaDecoderLayeremb; speculators' norm_before_residual): h = fc(cat(aux states));
    x = cat(input_layernorm(embed), hidden_norm(h)); h' = residual + attn(x); out = h' + mlp(post_norm(h'));
    logits = lm_head(norm(out)) over the draft vocabulary, target id = draft id + d2t; nodes feed ``out``."""
    heads, eps, theta = c["num_attention_heads"], c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
    h = t["fc.weight"].shape[0]
    d = c.get("head_dim") or h // heads
    kv = t["midlayer.self_attn.k_proj.weight"].shape[0] // d
    embed = t.get("embed_tokens.weight", target.get_input_embeddings().weight)
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.arange(t["lm_head.weight"].shape[0]) + t["d2t"] if "d2t" in t else torch.arange(vocab)

    def forward(tokens, hidden):
        normed = rms(hidden, t["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([rms(embed[tokens], t["midlayer.input_layernorm.weight"], eps), normed], -1)
        hidden = (normed if norm_before_residual else hidden) + attention(x, t, "midlayer.", heads, kv, d, theta)
        return hidden + mlp(rms(hidden, t["midlayer.post_attention_layernorm.weight"], eps), t, "midlayer.")

    def logits_at(committed, path):
        with torch.no_grad():
            states = target_states(target, committed[:, :-1])
            feats = lin(torch.cat([states[i][0] for i in aux], -1), t, "fc")
            tokens = committed[0, 1:].tolist()
            for token in path:
                out = forward(torch.tensor(tokens), feats)
                tokens, feats = tokens + [token], torch.cat([feats, out[-1:]])
            draft = rms(forward(torch.tensor(tokens), feats)[-1], t["norm.weight"], eps) @ t["lm_head.weight"].T
            return torch.full((vocab,), float("-inf")).index_copy(0, ids, draft)

    return logits_at


def medusa_reference(blocks, heads_lm, target):
    """Medusa: head k = lm_k(ResBlock^L(f)), ResBlock(x) = x + SiLU(W x + b), f the final-norm feature before
    the root. ``blocks[k]`` = [(W, b), ...]; ``heads_lm[k]`` = the head's projection (None: the target's)."""
    head = target.get_output_embeddings().weight

    def logits_at(committed, path):
        with torch.no_grad():
            x = target_states(target, committed[:, :-1])[-1][0, -1]
            for w, b in blocks[len(path)]:
                x = x + F.silu(x @ w.T + (0 if b is None else b))
            lm = heads_lm[len(path)]
            return x @ (head if lm is None else lm).T

    return logits_at


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


def write(folder: Path, config: dict | None, tensors: dict, filename: str) -> Path:
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
    return write(tmp, c, t, "pytorch_model.bin"), eagle1_reference(t, c, target), "eagle"


def eagle1_qwen(tmp, target, g):
    """An EAGLE-1 draft for a Qwen2 target: model.safetensors, "bias": false, "qkv_bias": true, GQA, no
    embed_tokens (the target's table), no rope_theta (10000, where the target's is 1e6)."""
    h = 32
    t = {"fc.weight": rnd(g, h, 2 * h), **decoder_layer(g, "layers.0.", h, 4, 2, 8, 48, h, qkv_bias=True,
                                                          input_norm=False)}
    c = {"architectures": ["Qwen2ForCausalLM"], "bias": False, "qkv_bias": True, "hidden_size": h,
         "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "model_type": "qwen2", "vocab_size": 64, "torch_dtype": "float32"}
    return write(tmp, c, t, "model.safetensors"), eagle1_reference(t, c, target), "eagle"


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
    return write(tmp, c, t, "model.safetensors"), eagle3_reference(t, c, target, (2, 2, 1)), "eagle3"


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
    return write(tmp, c, stored, "model.safetensors"), eagle3_reference(t, c, target, (1, 2, 3)), "eagle3"


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
    return write(tmp, c, t, "model.safetensors"), eagle3_reference(ref, c_layer, target, (1, 3, 2), True), "eagle3"


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
    return write(tmp, c, t, "model.safetensors"), eagle3_reference(ref, c, target, (1, 2, 3)), "eagle3"


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
    return write(tmp, c, t, "medusa_lm_head.pt"), medusa_reference(blocks, lms, target), "medusa"


def medusa_v2(tmp, target, g):
    """Medusa "v2" (TGI): medusa_lm_head.safetensors with residual blocks only; the target's lm_head."""
    h = 32
    t, blocks = {}, {}
    for k in range(3):
        w, b = rnd(g, h, h, scale=0.3), rnd(g, h)
        t.update({f"{k}.0.linear.weight": w, f"{k}.0.linear.bias": b})
        blocks[k] = [(w, b)]
    c = {"medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": "tiny/qwen2"}
    return write(tmp, c, t, "medusa_lm_head.safetensors"), medusa_reference(blocks, {k: None for k in range(3)},
                                                                             target), "medusa"


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
    return write(tmp, c, t, "model.safetensors"), medusa_reference(blocks, lms, target), "medusa"


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
    return write(tmp, c, t, "model.safetensors"), medusa_reference(blocks, lms, target), "medusa"


CASES = {  # name → (synthesiser, target, expected module type)
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
    make, target_name, _ = CASES[name]
    target = targets[target_name]
    folder, reference, fmt = make(tmp_path / name, target, torch.Generator().manual_seed(len(name)))
    return target, folder, reference, fmt


# -- proposals against the reference ------------------------------------------------------------------------
def recorded_run(drafter, target, tree, max_new_tokens=12, **kwargs):
    """generate() with every proposal recorded: (result, [(committed, proposal), ...])."""
    seen, propose = [], drafter.propose

    def recording(committed, feature, step_tree, sampling, generator=None):
        proposals = propose(committed, feature, step_tree, sampling, generator)
        seen.append((committed.row(0)[None].clone(), proposals.row(0)))  # one prompt: one row
        return proposals

    drafter.propose = recording
    out = generate(target, PROMPT, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens, **kwargs)
    drafter.propose = propose
    return out, seen


def check_proposal(committed, proposal, logits_at, sampling=None):
    """Every node's children are what the reference says: the rank-r child is the reference's r-th likeliest
    token (top-k candidates), or q_draft at the node is the reference's distribution (sampled ones)."""
    tree, tokens = proposal.tree, [None, *proposal.tokens.tolist()]
    paths = {0: []}
    for i in range(1, tree.num_nodes):
        paths[i] = [*paths[int(tree.parents[i])], tokens[i]]
    checked = 0
    for i in range(tree.num_nodes):
        kids = list(tree.children[i])
        if not kids:
            continue
        ref = logits_at(committed, paths[i]).float()
        if proposal.q_draft is None:
            order = ref.sort(descending=True).values
            for kid in kids:
                rank = int(tree.ranks[kid])
                assert abs(float(ref[tokens[kid]] - order[rank])) < 1e-4, (i, kid, rank)
        else:
            q = probs(ref, sampling)
            assert torch.allclose(proposal.q_draft[i].float(), q, atol=1e-5), i
            assert all(float(q[tokens[k]]) > 0 for k in kids)
        checked += 1
    return checked


@pytest.mark.parametrize("name", list(CASES))
def test_upstream_checkpoint_matches_the_published_equations(name, tmp_path, targets):
    target, folder, reference, fmt = synthesise(name, tmp_path, targets)
    assert registry.detect(folder).format == fmt
    drafter = load(folder, target)
    assert isinstance(getattr(drafter, "model", getattr(drafter, "heads", None)), CASES[name][2])
    tree = Tree.full(2, 2) if fmt != "medusa" else Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    out, seen = recorded_run(drafter, target, tree)
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 12))  # greedy equals vanilla
    assert sum(check_proposal(c, p, reference) for c, p in seen[:3]) >= 3
    if fmt != "medusa":  # the dynamic default tree too, and the logits themselves
        out, seen = recorded_run(drafter, target, DynamicTree(6, 3, 2), max_new_tokens=6)
        assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 6))
        check_proposal(*seen[0], reference)
        model, committed = drafter.model, seen[0][0]
        states = target_states(target, committed[:, :-1])
        feats = model.fuse(torch.cat([states[i] for i in model.feature_layers], -1))
        with torch.no_grad():
            mine = model.logits(model(committed[:, 1:], feats)[0, -1])
        ref = reference(committed, [])
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(mine)) and torch.allclose(mine[finite], ref[finite], atol=1e-4)


@pytest.mark.parametrize("name", ["eagle1-official-llama", "eagle3-speculators-llama", "eagle3-specforge-qwen2"])
def test_sampled_candidates_carry_the_reference_distribution(name, tmp_path, targets):
    target, folder, reference, _ = synthesise(name, tmp_path, targets)
    drafter = load(folder, target, candidates="sample")
    sampling = Sampling(1.0)
    _, seen = recorded_run(drafter, target, Tree.full(2, 2), max_new_tokens=5, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))
    assert all(p.q_draft is not None for _, p in seen)
    assert sum(check_proposal(c, p, reference, sampling) for c, p in seen[:2]) >= 4


# -- sampling is lossless (chi-square on a 4-token vocabulary) ----------------------------------------------------
def test_sampling_is_lossless_for_a_loaded_checkpoint(tmp_path):
    """A speculators EAGLE-3 checkpoint (3-of-4 draft vocabulary, norm_before_residual, sampled candidates verified
    with SpecInfer's rule) drives sampling whose output is exactly the target's distribution. 1,200 runs, as
    tests/test_eagle3.py: enough to catch a q_draft off by 0.15 (the harness's own negative control is in
    tests/test_lossless.py)."""
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=2, seed=11, init_std=0.1)
    g = torch.Generator().manual_seed(5)
    d2t, t2d = build_vocab_map(torch.tensor([0, 5, 3, 9]), 3)
    t = {"fc.weight": rnd(g, 16, 48, scale=0.5), **eagle3_layer(g, 16, 2, 2, 8, 32, prefix="layers.0."),
         "norm.weight": norm_w(g, 16), "lm_head.weight": rnd(g, 3, 16, scale=1.5), "d2t": d2t, "t2d": t2d}
    c_layer = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
               "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB}
    write(tmp_path / "e3", speculators_config(c_layer, 3, [1, 1, 2], True, h=16), t, "model.safetensors")
    drafter = load(tmp_path / "e3", small, candidates="sample")
    assert drafter.model.draft_ids.tolist() == [1, 2, 3] and drafter.model.norm_before_residual
    sampling = Sampling(1.0)
    counts = sampled_counts(small, drafter, Tree.full(2, 2), sampling, runs=1200)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


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
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", rule["file"]])
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
ROUND_TRIP_TREE = Tree.full(2, 2)


def proposals(drafter, target, tree=ROUND_TRIP_TREE):
    out, seen = recorded_run(drafter, target, tree, max_new_tokens=8)
    return out.sequences.tolist(), [(p.tree.paths, p.tokens.tolist()) for _, p in seen]


def fresh(kind, target, seed=0):
    """Drafters built in treespec (random weights), in the form each consumer can take."""
    torch.manual_seed(seed)
    if kind == "eagle":
        model = EagleModel(target, variant="upstream", layer_overrides={"num_hidden_layers": 2})
    elif kind == "eagle3":
        model = Eagle3Model(target, vocab_map=build_vocab_map(torch.randint(0, 100, (64,)), 24))
    else:
        model = MedusaHeads(32, 64, num_heads=3, num_layers=1, share_lm_head=False,
                            lm_head=target.get_output_embeddings())
        with torch.no_grad():
            for block in model.blocks:
                block[0].linear.weight.normal_(0, 0.3)
                block[0].linear.bias.normal_(0, 0.1)
    return model.eval()


EXPORTS = [("eagle", "sglang"), ("eagle", "vllm"), ("eagle", "eagle"), ("eagle3", "sglang"), ("eagle3", "vllm"),
           ("eagle3", "speculators"), ("eagle3", "eagle"), ("medusa", "vllm"), ("medusa", "medusa")]


@pytest.mark.parametrize("kind, consumer", EXPORTS, ids=[f"{k}-{c}" for k, c in EXPORTS])
def test_export_follows_the_consumer_and_loads_back_identically(kind, consumer, tmp_path, targets):
    target = targets["llama"]
    model = fresh(kind, target)
    if kind == "eagle" and consumer == "vllm":  # vLLM's EAGLE fc has no bias (a nonzero one is refused below)
        with torch.no_grad():
            model.fc.bias.zero_()
    if kind == "eagle3" and consumer == "eagle":  # the official code hard-codes aux layers (2, L//2, L-3)
        model = Eagle3Model(target, aux_layers=(2, 2, 1), vocab_map=(model.d2t, model.t2d)).eval()
    folder = export(model, target, tmp_path / "out", to=consumer, verifier="tiny/llama")
    check_consumer(folder, consumer, kind, model, target)
    back = load(folder, target)
    assert proposals(back, target) == proposals(registry.AUTO.make(model), target)


@pytest.mark.parametrize("name", ["eagle1-qkvbias-qwen2", "eagle3-specforge-qwen2", "eagle3-speculators-llama",
                                  "medusa-v2-qwen2"])
def test_upstream_checkpoints_re_export(name, tmp_path, targets):
    """Loaded upstream drafters (Qwen2 q/k/v biases, own embeddings, norm_before_residual, a shared lm_head)
    export to every consumer that can hold them, load back identically, and are refused by the others."""
    target, folder, _, fmt = synthesise(name, tmp_path, targets)
    module = registry.AUTO.load(folder, target)
    reference = proposals(registry.AUTO.make(module), target)
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
        assert proposals(load(out, target), target) == reference, consumer
        done.append((consumer, "ok", ""))
    status = {c: s for c, s, _ in done}
    expected = {"eagle1-qkvbias-qwen2": {"sglang": "ok", "vllm": "ok", "eagle": "ok"},
                "eagle3-specforge-qwen2": {"sglang": "ok", "vllm": "ok", "speculators": "ok", "eagle": "refused"},
                "eagle3-speculators-llama": {"sglang": "refused", "vllm": "ok", "speculators": "ok",
                                             "eagle": "refused"},
                "medusa-v2-qwen2": {"vllm": "ok", "medusa": "ok"}}[name]
    assert status == expected, done


# -- refusals ----------------------------------------------------------------------------------------------------
def test_exports_that_a_consumer_cannot_represent_are_refused(tmp_path, targets):
    llama, qwen = targets["llama"], targets["qwen2"]
    torch.manual_seed(0)
    untied = MedusaHeads(32, 64, num_heads=2, num_layers=2, lm_head=llama.get_output_embeddings())
    with torch.no_grad():
        untied.blocks[0][1].linear.weight.normal_()
    cases = [
        (EagleModel(llama), llama, "sglang", "input norm on layer 0 and a final norm"),
        (EagleModel(llama, feature_layers=(1, 2, -1), variant="upstream"), llama, "vllm", "fused EAGLE drafter"),
        (EagleModel(llama, variant="upstream"), llama, "vllm", r"no fc\.bias .* nonzero"),
        (EagleModel(llama, variant="upstream"), llama, "speculators", "eagle3 format only"),
        (EagleModel(llama, variant="upstream"), llama, "medusa", "cannot be written as Medusa"),
        (Eagle3Model(qwen, layer="target"), qwen, "sglang",  # the target's own class: Qwen2's q/k/v biases
         r"no midlayer\.self_attn\.[qkv]_proj\.bias \(SGLang's EAGLE-3 q/k/v"),
        (Eagle3Model(llama), llama, "eagle", r"hard-codes aux layers \(2, L//2, L-3\)"),
        (Eagle3Model(llama, aux_layers=(0, 2, 3)), llama, "vllm", "inputs of decoder layers 1..3 only"),
        (Eagle3Model(llama), llama, "medusa", "cannot be written as Medusa"),
        (MedusaHeads(32, 64, num_heads=2, lm_head=llama.get_output_embeddings()), llama, "sglang",
         "does not load Medusa"),
        (untied, llama, "medusa", "repeats one residual block"),
    ]
    for module, target, consumer, message in cases:
        with pytest.raises(Refused, match=message):
            export(module, target, tmp_path / "x", to=consumer)
        assert not (tmp_path / "x").exists()  # nothing written
    nbr = load(synthesise("eagle3-speculators-llama", tmp_path, targets)[1], llama).model
    with pytest.raises(Refused, match="norm_before_residual"):
        export(nbr, llama, tmp_path / "y", to="sglang")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds pytorch_model.bin"):
        export(Eagle3Model(llama), llama, tmp_path / "z", to="vllm")
    with pytest.raises(ValueError, match="to must be one of"):
        export(Eagle3Model(llama), llama, tmp_path / "w", to="tgi")


# -- errors on load ---------------------------------------------------------------------------------------------
class Boom:
    """Unpickling this would create a file; torch.load(weights_only=True) must refuse it first."""

    def __reduce__(self):
        return (Path.touch, (Path("/tmp/treespec_interop_pwned"),))


def test_broken_checkpoints_are_errors_naming_what_is_wrong(tmp_path, targets):
    llama, qwen = targets["llama"], targets["qwen2"]
    good, _, _ = eagle1_official(tmp_path / "good", llama, torch.Generator().manual_seed(0))

    def copy(name):
        folder = tmp_path / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    bad = copy("truncated-bin")
    (bad / "pytorch_model.bin").write_bytes((good / "pytorch_model.bin").read_bytes()[:500])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be read with torch\.load\(weights_only=True\)"):
        load(bad, llama)
    bad = copy("code-in-pickle")
    Path("/tmp/treespec_interop_pwned").unlink(missing_ok=True)
    torch.save({"fc.weight": torch.zeros(2), "x": Boom()}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        load(bad, llama)
    assert not Path("/tmp/treespec_interop_pwned").exists()
    bad = copy("nan")
    weights = torch.load(good / "pytorch_model.bin", weights_only=True)
    weights["fc.bias"][0] = float("nan")
    torch.save(weights, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="'fc.bias' holds non-finite values"):
        load(bad, llama)
    bad = copy("corrupt-safetensors")
    (bad / "pytorch_model.bin").unlink()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read as safetensors"):
        load(bad, llama)
    bad = copy("truncated-config")
    (bad / "config.json").write_text('{"num_attention_heads": 2, "rms_n')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load(bad, llama)
    bad = copy("bias-flag")
    (bad / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "bias": False}))
    with pytest.raises(ValueError, match=r"says fc has no bias .* fc\.bias is present"):
        load(bad, llama)
    with pytest.raises(ValueError, match=r"fc\.weight is \(32, 64\); a drafter for this target \(hidden size 48\)"):
        load(good, tiny_llama(hidden=48, layers=4))
    with pytest.raises(ValueError, match="vocabulary of 64 tokens .* the target has 80"):
        load(good, tiny_llama(vocab=80, layers=4))
    with pytest.raises(ValueError, match="format='eagle3' was asked for, but .* holds a 'eagle' checkpoint"):
        load(good, llama, format="eagle3")
    e3, _, _ = eagle3_specforge(tmp_path / "e3", qwen, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"aux layers \[1, 2, 3\] .* do not exist in a 2-layer target"):
        load(e3, tiny_qwen2(layers=2))
    weights = load_file(e3 / "model.safetensors")
    del weights["model.d2t"], weights["model.t2d"]
    save_file(weights, str(e3 / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary of 48 tokens .* needs d2t"):
        load(e3, qwen)
    spec, _, _ = eagle3_speculators(tmp_path / "spec", llama, torch.Generator().manual_seed(2))
    config = json.loads((spec / "config.json").read_text())
    del config["norm_before_residual"]
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks norm_before_residual, which vLLM reads as true"):
        load(spec, llama)
    unknown = write(tmp_path / "unknown", {"model_type": "gpt2"}, {"wte.weight": torch.zeros(4, 2)},
                    "model.safetensors")
    with pytest.raises(ValueError, match=r"unrecognised drafter layout \(tensors: wte\.weight\)"):
        load(unknown, llama)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no drafter weights found"):
        load(tmp_path / "empty", llama)
    with pytest.raises(FileNotFoundError, match="no such folder, and not a Hugging Face Hub repo id"):
        load(tmp_path / "missing" / "deeper", llama)
    m1, _, _ = medusa1(tmp_path / "m1", llama, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"lm_head of head 0 is \(64, 32\); this target needs \[80, 32\]"):
        load(m1, tiny_llama(vocab=80, layers=4))
    with pytest.raises(ValueError, match=r"drafter 'medusa' takes candidates in \('topk',\), got 'sample'"):
        load(m1, llama, candidates="sample")


def test_hub_ids_download_or_explain_how_to_pass_a_folder(tmp_path, targets, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    llama = targets["llama"]
    folder, _, _ = medusa1(tmp_path / "hub", llama, torch.Generator().manual_seed(0))
    asked = []

    def offline(repo_id, **kwargs):
        asked.append(repo_id)
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic has "
                                      "been disabled.")

    monkeypatch.setattr(detect_module, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"could not be fetched from the Hugging Face Hub .* pass the folder: "
                                                r"treespec\.heads\.load\('DIR', target\)"):
        load("someone/medusa-heads", llama)
    monkeypatch.setattr(detect_module, "snapshot_download", lambda repo_id, **kwargs: asked.append(repo_id) or folder)
    assert isinstance(load("someone/medusa-heads", llama).heads, MedusaHeads)
    assert asked == ["someone/medusa-heads"] * 2


# -- treespec's own formats and the registry ----------------------------------------------------------------------
def test_treespec_folders_and_the_registry(tmp_path, targets):

    llama = targets["llama"]
    model = fresh("eagle", llama)
    model.save_pretrained(tmp_path / "mine")
    saved = json.loads((tmp_path / "mine" / "eagle_config.json").read_text())
    assert saved["variant"] == "upstream" and saved["layer_overrides"] == {"num_hidden_layers": 2}
    assert registry.detect(tmp_path / "mine").format == "treespec"
    back = load(tmp_path / "mine", llama)
    assert proposals(back, llama) == proposals(registry.AUTO.make(model), llama)
    # an upstream EAGLE-3 whose layer differs from the target's (own table, norm_before_residual) round-trips too
    _, spec, _, _ = synthesise("eagle3-speculators-llama", tmp_path, targets)
    up = load(spec, llama).model
    up.save_pretrained(tmp_path / "up3")
    assert proposals(load(tmp_path / "up3", llama), llama) == proposals(registry.AUTO.make(up), llama)
    kind = registry.get("auto")
    drafter = registry.build("auto", llama, source=str(spec), candidates="sample")
    assert drafter.candidates == "sample" and kind.max_depth(drafter.model) is None
    windows = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    acc = kind.rank_accuracy(llama, drafter.model, windows, depth=2, top_k=3)
    assert len(acc) == 2 and all(len(row) == 3 for row in acc)
    medusa = registry.load_module("auto", llama, source=str(synthesise("medusa1-llama", tmp_path, targets)[1]))
    assert kind.max_depth(medusa) == 3 and kind.rank_accuracy(llama, medusa, windows, top_k=2)


def test_shipped_eagle_drafter_still_loads_as_the_treespec_variant():
    from treespec import reference

    target, _ = reference.load("target")
    model = load(reference.MODELS_DIR / "eagle", target).model
    assert model.variant == "treespec" and "variant" not in model.config
    assert not any(re.match(r"embed_tokens", k) for k in model.state_dict())


# -- exports as their consumers load them -------------------------------------------------------------
def tiny_qwen3(vocab=64, layers=4, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         initializer_range=0.2, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return Qwen3ForCausalLM(config).eval()


def test_a_qwen3_head_exports_to_every_serving_stack(tmp_path):
    """The EAGLE-3 layer is Llama-style by default whatever the target, so a head for a Qwen3 target exports to
    vLLM, SGLang and speculators and loads back identically; the target's own classes (q/k norms) stay an
    option that only treespec loads, refused with the way out."""
    from treespec.heads.export import formats

    qwen3 = tiny_qwen3()
    torch.manual_seed(0)
    model = Eagle3Model(qwen3, vocab_map=build_vocab_map(torch.randint(0, 100, (64,)), 24)).eval()
    assert not any("q_norm" in k for k in model.state_dict())
    reference = proposals(registry.AUTO.make(model), qwen3)
    for consumer in ("vllm", "sglang", "speculators"):
        folder = export(model, qwen3, tmp_path / consumer, to=consumer, verifier="tiny/qwen3")
        check_consumer(folder, consumer, "eagle3", model, qwen3)
        assert proposals(load(folder, qwen3), qwen3) == reference, consumer
    own = Eagle3Model(qwen3, layer="target")
    with pytest.raises(Refused, match=r"q/k norms .* layer='llama' \(the default\) exports"):
        export(own, qwen3, tmp_path / "own", to="vllm")
    reach = formats(own, qwen3, before_training=True)
    assert all("q/k norms" in reach[c] for c in ("vllm", "sglang", "speculators"))
    assert {c for c, why in formats(model, qwen3).items() if why is None} >= {"vllm", "sglang", "speculators"}


def test_training_checks_export_targets_at_start_up(capsys):
    from treespec.heads.eagle3 import objective as eagle3_recipe
    from treespec.train.training.exportable import check_export_targets

    from .helpers import compose_cfg

    qwen3 = tiny_qwen3()
    state = torch.random.get_rng_state()
    cfg = compose_cfg("train_heads", ["drafter=eagle3", "drafter.draft_vocab_size=24", "export_to=[vllm,speculators]"])
    assert {"vllm", "sglang", "speculators"} <= set(check_export_targets(cfg, qwen3, eagle3_recipe.recipe))
    assert torch.equal(state, torch.random.get_rng_state())  # the probe leaves the run's seed alone
    assert "eagle3: exportable to" in capsys.readouterr().out
    cfg = compose_cfg("train_heads", ["drafter=eagle3", "drafter.layer=target", "export_to=[vllm]"])
    with pytest.raises(ValueError, match=r"export_to names vllm, which this eagle3 drafter cannot be exported to: "
                                         r"vllm: .*q/k norms.*\(drafter\.layer=llama"):
        check_export_targets(cfg, qwen3, eagle3_recipe.recipe)


def test_speculators_export_carries_the_targets_token_table(tmp_path, targets):
    """speculators' loader builds embed_tokens and leaves it all zeros when the file lacks it: the export carries
    the target's table (treespec reads it back as the target's, not a table of the drafter's own)."""
    llama = targets["llama"]
    model = fresh("eagle3", llama)
    folder = export(model, llama, tmp_path / "spec", to="speculators", verifier="tiny/llama")
    table = load_file(folder / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(table, llama.get_input_embeddings().weight.detach())
    assert getattr(load(folder, llama).model, "embed_tokens", None) is None


def test_the_verifier_is_a_name_another_machine_resolves(tmp_path, targets):
    """speculators records the target it verifies with; a local folder would fail on any other machine."""
    llama = targets["llama"]
    model = fresh("eagle3", llama)
    llama.config._name_or_path = str(tmp_path / "my-target")
    (tmp_path / "my-target").mkdir()
    try:
        with pytest.raises(ValueError, match=r"local folder .*my-target.* verifier='org/name' .*--verifier"):
            export(model, llama, tmp_path / "a", to="speculators")
        assert not (tmp_path / "a").exists()
        folder = export(model, llama, tmp_path / "b", to="speculators", verifier="org/target")
        assert json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] \
            == "org/target"
        export(model, llama, tmp_path / "c", to="vllm")  # vLLM's own layout records no verifier
        llama.config._name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
        folder = export(model, llama, tmp_path / "d", to="speculators")
        assert json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] \
            == "meta-llama/Llama-3.1-8B-Instruct"
    finally:
        llama.config._name_or_path = ""


def test_norm_output_is_read_by_the_convention_of_its_writer(tmp_path, targets):
    """SpecForge's trainer reads norm_output (default true) as 'the final norm before lm_head'; SGLang's server
    and speculators (default false) as EAGLE 3.1. Absent, all mean plain EAGLE-3."""
    qwen = targets["qwen2"]
    folder, reference, _ = eagle3_specforge(tmp_path / "sf", qwen, torch.Generator().manual_seed(1))
    config = json.loads((folder / "config.json").read_text())
    plain = proposals(load(folder, qwen), qwen)

    def with_config(name, **fields):
        out = tmp_path / name
        out.mkdir()
        (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out

    specforge_true = with_config("sf-true", norm_output=True)
    with pytest.raises(ValueError, match=r"norm_output: true in a LlamaForCausalLMEagle3 config is ambiguous.*"
                                         r"written_by='specforge'.*written_by='serving'.*--written-by"):
        load(specforge_true, qwen)
    assert proposals(load(specforge_true, qwen, written_by="specforge"), qwen) == plain
    with pytest.raises(ValueError, match=r"norm_output: true \(EAGLE 3\.1"):
        load(specforge_true, qwen, written_by="serving")
    specforge_false = with_config("sf-false", norm_output=False)
    with pytest.raises(ValueError, match=r"norm_output: false \(SpecForge: lm_head on the un-normed output"):
        load(specforge_false, qwen, written_by="specforge")
    assert proposals(load(specforge_false, qwen, written_by="serving"), qwen) == plain
    vllm = with_config("vllm", norm_output=False, architectures=["Eagle3LlamaForCausalLM"])
    assert proposals(load(vllm, qwen), qwen) == plain  # vLLM's class: the serving convention, no flag needed
    with pytest.raises(ValueError, match="written_by must be one of"):
        load(vllm, qwen, written_by="sglang-ish")
    spec, _, _ = eagle3_speculators(tmp_path / "spec", targets["llama"], torch.Generator().manual_seed(2))
    spec_config = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({**spec_config, "norm_output": True}))
    with pytest.raises(ValueError, match=r"norm_output: true \(EAGLE 3\.1"):
        load(spec, targets["llama"])
    with pytest.raises(ValueError, match="written_by applies to upstream EAGLE-3 checkpoints"):
        load(synthesise("medusa1-llama", tmp_path / "m", targets)[1], targets["llama"], written_by="specforge")

"""DFlash checkpoints in z-lab's layout (heads/dflash/upstream.py; the drafter: tests/heads/dflash/test_dflash.py): a
hand-built checkpoint loads and computes the published math (written out here), one made for another target is
refused, and treespec's drafters export to SGLang and vLLM and load back identically (the others refuse)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from treespec import generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DFlash, load, registry
from treespec.heads.checkpoints.export import export
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.training.target_states import target_states

from tests.helpers import (
    hf_greedy,
    norm_w,
    rnd,
    write_checkpoint,
)


# -- z-lab's layout --------------------------------------------------------------------------------------------------
def zlab_checkpoint(folder, g, *, prefix="", **config_changes):
    """A random DFlash checkpoint written as z-lab publishes one, by hand: 2 layers of 4 heads (2 KV heads, head_dim
    8, MLP 48) over target layers 0 and 2, block 4, mask token 61."""
    h, heads, kv, d, inter = 32, 4, 2, 8, 48
    tensors = {"fc.weight": rnd(g, h, 2 * h), "hidden_norm.weight": norm_w(g, h), "norm.weight": norm_w(g, h)}
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
              "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    norms = {"self_attn.q_norm": d, "self_attn.k_norm": d, "input_layernorm": h, "post_attention_layernorm": h}
    for i in range(2):
        tensors.update({f"layers.{i}.{name}.weight": rnd(g, *shape) for name, shape in shapes.items()})
        tensors.update({f"layers.{i}.{name}.weight": norm_w(g, n) for name, n in norms.items()})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "num_hidden_layers": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 256, "vocab_size": 64, "block_size": 4, "num_target_layers": 4,
              "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 61}, **config_changes}
    write_checkpoint(folder, config, {prefix + k: v for k, v in tensors.items()}, "model.safetensors")
    return tensors, config


def zlab_logits(tensors, config, target, committed) -> torch.Tensor:
    """The published computation, written out: context = hidden_norm(fc(cat of hidden_states[id + 1])) for the
    tokens before the root; per layer, queries from the normed block, keys/values from the context (not normed by
    the layer) and the normed block, per-head q/k norms, RoPE, attention without a mask; norm; the target's
    lm_head on block positions 1.. → [block_size − 1, V]."""
    def rms(x, w, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, positions):  # x [n, heads, d]
        d = x.shape[-1]
        freqs = positions[:, None].double() / config["rope_theta"] ** (torch.arange(0, d, 2).double() / d)
        angles = torch.cat([freqs, freqs], -1)[:, None].float()
        return x * angles.cos() + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * angles.sin()

    t = {k: v.float() for k, v in tensors.items()}
    ids, size, heads, kv, d = config["dflash_config"]["target_layer_ids"], config["block_size"], 4, 2, 8
    n = committed.shape[1] - 1
    with torch.no_grad():
        hidden = target(input_ids=committed[:, :-1], output_hidden_states=True).hidden_states
        context = rms(torch.cat([hidden[i + 1][0] for i in ids], -1) @ t["fc.weight"].T, t["hidden_norm.weight"])
        block = torch.tensor([int(committed[0, -1])] + [config["dflash_config"]["mask_token_id"]] * (size - 1))
        x = target.get_input_embeddings()(block)
        pos_block, pos_all = torch.arange(n, n + size), torch.arange(n + size)
        for i in range(config["num_hidden_layers"]):
            p = f"layers.{i}."
            normed = rms(x, t[p + "input_layernorm.weight"])
            q = (normed @ t[p + "self_attn.q_proj.weight"].T).view(size, heads, d)
            q = rope(rms(q, t[p + "self_attn.q_norm.weight"]), pos_block)
            both = torch.cat([context, normed])
            k = (both @ t[p + "self_attn.k_proj.weight"].T).view(-1, kv, d)
            k = rope(rms(k, t[p + "self_attn.k_norm.weight"]), pos_all)
            v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, kv, d)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
            x = x + torch.einsum("hqk,khd->qhd", weights, v).reshape(size, -1) @ t[p + "self_attn.o_proj.weight"].T
            mlp_in = rms(x, t[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(mlp_in @ t[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (mlp_in @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        return target.get_output_embeddings()(rms(x, t["norm.weight"]))[1:]


def test_zlab_checkpoint_loads_and_computes_the_published_math(target, prompt, tmp_path):
    g = torch.Generator().manual_seed(0)
    for prefix in ("", "model."):
        folder = tmp_path / f"zlab{prefix}"
        tensors, config = zlab_checkpoint(folder, g, prefix=prefix)
        assert registry.detect(folder).format == "dflash"
        drafter = load(folder, target)
        model = drafter.model
        assert (model.block_size, model.target_layer_ids, model.mask_token_id, model.num_layers) == (4, (0, 2), 61, 2)
        assert model.layer_config.num_attention_heads == 4 and model.layer_config.rope_parameters["rope_theta"] == 1e6
        committed = torch.cat([prompt, torch.tensor([[7]])], 1)
        n = prompt.shape[1]
        with torch.no_grad():
            features, _ = target_states(target, prompt, model.feature_layers)
            ours = model.logits(model(model.block_ids(torch.tensor([7])), features, torch.arange(n, n + 4)[None],
                                      torch.arange(n)[None])[0, 1:])
        torch.testing.assert_close(ours, zlab_logits(tensors, config, target, committed), atol=1e-4, rtol=1e-4)
        out = generate(target, prompt, drafter=drafter, tree=DynamicTree(8, 3, 2), max_new_tokens=12)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))


@pytest.mark.parametrize("change, message", [
    ({"num_target_layers": 36}, "made for a target of 36 layers \\(num_target_layers\\), the target has 4"),
    ({"vocab_size": 151936}, "vocabulary of 151936 tokens"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "no mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [0, 4], "mask_token_id": 61}}, r"ids in 0..3"),
    ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 61}}, r"projects 2 target states"),
    ({"num_hidden_layers": 3}, "num_hidden_layers 3 .config.json. but the tensors hold 2 layers"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "sliding-window draft layers"),
])
def test_zlab_checkpoint_for_another_target_is_refused(target, tmp_path, change, message):
    zlab_checkpoint(tmp_path, torch.Generator().manual_seed(0), **change)
    with pytest.raises(ValueError, match=message):
        load(tmp_path, target)


def test_export_round_trip(target, prompt, trained, tmp_path):
    for to in ("sglang", "vllm"):
        folder = export(DFlash(trained), target, tmp_path / to, to=to)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
        assert config["dflash_config"] == {"target_layer_ids": [2], "mask_token_id": 63, "block_size": 4}
        assert config["num_target_layers"] == 4 and config["num_hidden_layers"] == 1
        back = load(folder, target).model
        assert sorted(load_file(folder / "model.safetensors")) == sorted(trained.state_dict())
        n = prompt.shape[1]
        with torch.no_grad():
            features, _ = target_states(target, prompt, trained.feature_layers)
            a, b = (m.logits(m(m.block_ids(prompt[:, -1]), features, torch.arange(n, n + 4)[None],
                               torch.arange(n)[None])) for m in (trained, back))
        assert torch.equal(a, b)
    for to in ("speculators", "eagle", "medusa"):
        with pytest.raises(Refused, match="has no DFlash drafter"):
            export(DFlash(trained), target, tmp_path / to, to=to)

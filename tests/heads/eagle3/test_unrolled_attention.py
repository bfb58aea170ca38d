"""The unrolled steps' merged attention (heads/training/unrolled_attention.py) against the dense masked attention it
replaces: the same outputs, loss and gradients, with grouped-query attention, packed conversations and bf16."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.heads.eagle3.objective import eagle3_loss
from treespec.heads.training import unrolled_attention
from treespec.heads.training.target_states import target_states
from treespec.heads.training.unroll import unrolled

from tests.helpers import random_eagle3


def gqa_target(heads: int = 4, kv_heads: int = 2, attn: str = "treespec_sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         initializer_range=0.2, attn_implementation=attn, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def run(model, target, batch, *, merged: bool, monkeypatch, precision=torch.float32):
    """eagle3_loss with the merged attention on or off → (loss, metrics, gradients)."""
    with monkeypatch.context() as m:
        if not merged:
            m.setattr(unrolled_attention, "applies", lambda config, device: False)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
            loss, metrics = eagle3_loss(target, model, batch, unroll_steps=3, decay=0.8)
        loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kv_heads, attn", [(4, "sdpa"), (2, "sdpa"), (2, "treespec_sdpa")])
def test_merged_attention_gives_the_dense_losses_and_gradients(kv_heads, attn, monkeypatch):
    target = gqa_target(kv_heads=kv_heads, attn=attn)
    model = random_eagle3(target, draft_vocab=40, seed=1)
    assert unrolled_attention.applies(model.layer_config, "cpu")
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, metrics, grads = run(model, target, batch, merged=True, monkeypatch=monkeypatch)
    loss_d, metrics_d, grads_d = run(model, target, batch, merged=False, monkeypatch=monkeypatch)
    assert loss.item() == pytest.approx(loss_d.item(), rel=1e-5)
    assert metrics == pytest.approx(metrics_d, rel=1e-4, abs=1e-6)
    assert grads.keys() == grads_d.keys() and grads
    for name in grads:
        assert torch.allclose(grads[name], grads_d[name], rtol=1e-4, atol=1e-6), name


def test_merged_attention_stays_inside_packed_conversations_and_holds_in_bf16(monkeypatch):
    target = gqa_target()
    model = random_eagle3(target, draft_vocab=40, seed=2)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(8), torch.arange(12)])[None].repeat(2, 1)  # two conversations a row
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "position_ids": positions}
    loss, _, grads = run(model, target, batch, merged=True, monkeypatch=monkeypatch)
    loss_d, _, grads_d = run(model, target, batch, merged=False, monkeypatch=monkeypatch)
    assert loss.item() == pytest.approx(loss_d.item(), rel=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads_d[name], rtol=1e-4, atol=1e-6), name
    # bf16 autocast, as CPU training runs: the two agree to bf16's precision
    loss, _, grads = run(model, target, batch, merged=True, monkeypatch=monkeypatch, precision=torch.bfloat16)
    loss_d, _, grads_d = run(model, target, batch, merged=False, monkeypatch=monkeypatch, precision=torch.bfloat16)
    assert loss.item() == pytest.approx(loss_d.item(), rel=2e-2)
    for name in grads:
        assert torch.allclose(grads[name], grads_d[name], rtol=0.1, atol=0.1 * grads_d[name].abs().max()), name


def test_the_outputs_of_every_step_match(monkeypatch):
    target = gqa_target()
    model = random_eagle3(target, draft_vocab=40, seed=3)
    batch = torch.randint(0, 64, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features, _ = target_states(target, batch, model.aux_layers)
        fused = model.fuse(features[:, :-1])
        merged = dict(unrolled(model, batch, fused, 4, by_root=True))
        monkeypatch.setattr(unrolled_attention, "applies", lambda config, device: False)
        dense = dict(unrolled(model, batch, fused, 4, by_root=True))
    for i in dense:
        assert torch.allclose(merged[i], dense[i], atol=1e-5), i

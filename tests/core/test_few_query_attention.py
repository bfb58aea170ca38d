"""The native few-query attention kernel (treespec/few_query_attention.c, through treespec/gqa_attention.py): agreement
with torch's SDPA over the shapes a tree pass makes (cache views with strides, grouped and ungrouped heads, any number
of queries up to its limit, every head size it takes, per-row and shared masks), the calls it hands to torch, and
greedy equality with transformers on a real grouped model. Greedy equality on the architecture matrix runs through it
in tests/core/test_gqa_attention.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from treespec import Tree, generate
from treespec.gqa_attention import (
    NATIVE_QUERIES,
    native_attention,
    native_available,
    native_takes,
    sdpa_gqa_in_place,
    transposed_once,
    use_native_attention,
)
from treespec.train.checks.lossless import hf_greedy

pytestmark = pytest.mark.skipif(not native_available(), reason="the native attention kernel needs AVX-512 and a C "
                                                               "compiler")


def layer(groups: int, native: bool = True):
    return types.SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False,
                                 treespec_native_attention=native)


def case(batch, heads, kv, queries, keys, dim, seed=0, spare=7):
    """query [b, h, q, d] as transformers makes it (a transposed view), keys/values as views of a longer preallocated
    cache [b, kv, keys + spare, d], an additive mask [b, 1, q, keys] with float32's min where a key is hidden."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, dim, generator=gen).transpose(1, 2)
    k = torch.randn(batch, kv, keys + spare, dim, generator=gen)[:, :, :keys]
    v = torch.randn(batch, kv, keys + spare, dim, generator=gen)[:, :, :keys]
    seen = torch.rand(batch, 1, queries, keys, generator=gen) > 0.3
    seen[..., 0] = True
    mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo().min)
    return q, k, v, mask


def expected(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("batch, heads, kv, queries, keys, dim", [
    (1, 9, 3, 16, 272, 64),   # SmolLM2's 16-token pass
    (2, 9, 3, 5, 40, 64),     # a batch, each row its own mask
    (1, 4, 2, 3, 33, 128),
    (1, 8, 8, 7, 19, 32),     # no grouping
    (1, 6, 2, 26, 300, 128),  # more rows than a block of 16, a tail of keys
    (1, 2, 1, 40, 50, 256),
    (1, 4, 1, NATIVE_QUERIES, 9, 16),
])
def test_it_agrees_with_torch_sdpa(batch, heads, kv, queries, keys, dim):
    q, k, v, mask = case(batch, heads, kv, queries, keys, dim, seed=queries)
    module = layer(heads // kv)
    assert native_takes(module, q, k, v, mask)
    got, _ = sdpa_gqa_in_place(module, q, k, v, mask, scaling=dim ** -0.5)
    assert got.shape == (batch, queries, heads, dim) and got.is_contiguous()
    torch.testing.assert_close(got, expected(q, k, v, mask, dim ** -0.5), rtol=1e-5, atol=2e-6)


def test_a_mask_shared_by_the_batch():
    q, k, v, mask = case(2, 4, 2, 6, 30, 32)
    got, _ = sdpa_gqa_in_place(layer(2), q, k, v, mask[:1], scaling=0.3)
    torch.testing.assert_close(got, expected(q, k, v, mask[:1], 0.3), rtol=1e-5, atol=2e-6)


def test_a_bool_mask_and_the_default_scale():
    q, k, v, mask = case(1, 4, 2, 4, 20, 16)
    got, _ = sdpa_gqa_in_place(layer(2), q, k, v, mask == 0)
    torch.testing.assert_close(got, expected(q, k, v, mask, 16 ** -0.5), rtol=1e-5, atol=2e-6)


def test_the_transposed_mask_is_made_once_per_mask_and_again_when_it_changes():
    _, _, _, mask = case(1, 2, 1, 4, 12, 16)
    first = transposed_once(mask)
    assert transposed_once(mask) is first and torch.equal(first, mask[:, 0].transpose(1, 2))
    other = mask.clone()
    assert transposed_once(other) is not first and transposed_once(mask) is first  # two held: full, sliding window
    mask[..., 1] = 0.0
    assert torch.equal(transposed_once(mask), mask[:, 0].transpose(1, 2))


@pytest.mark.parametrize("what", ["one query", "too many queries", "bfloat16", "a mask per head", "head size 40",
                                  "switched off", "a gradient", "a mask of other keys"])
def test_what_it_does_not_take_goes_to_torch(what):
    queries = {"one query": 1, "too many queries": NATIVE_QUERIES + 1}.get(what, 4)
    q, k, v, mask = case(1, 4, 2, queries, 24, 40 if what == "head size 40" else 32)
    module = layer(2, native=what != "switched off")
    if what == "bfloat16":
        q, k, v, mask = (t.bfloat16() for t in (q, k, v, mask))
    if what == "a mask per head":
        mask = mask.expand(1, 4, queries, 24)
    if what == "a gradient":
        q.requires_grad_(True)
    if what == "a mask of other keys":  # torch's error, as before
        mask = torch.cat([mask, mask[..., :3]], dim=-1)
        assert not native_takes(module, q, k, v, mask)
        with pytest.raises(RuntimeError):
            sdpa_gqa_in_place(module, q, k, v, mask, scaling=0.2)
        return
    assert not native_takes(module, q, k, v, mask)
    got, _ = sdpa_gqa_in_place(module, q, k, v, mask, scaling=0.2)
    want = expected(q, k, v, mask, 0.2)
    assert torch.equal(got, want) if what != "one query" else torch.allclose(got, want, atol=1e-6)
    if what == "a gradient":  # torch's kernel carried it
        got.sum().backward()
        assert q.grad is not None


def test_use_native_attention_switches_a_model():
    from treespec.train.checks.architectures import build
    model = build("Llama")
    use_native_attention(model, False)
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    assert layers and all(m.treespec_native_attention is False for m in layers)
    use_native_attention(model)
    assert all(m.treespec_native_attention is True for m in layers)


def test_greedy_tree_decoding_on_smollm2_equals_transformers(monkeypatch):
    """SmolLM2-135M (9 query heads over 3 key/value heads, head size 64) on treespec's CPU kernels, tree passes through
    the native kernel, against transformers' greedy on the same weights with stock sdpa and ``F.linear``."""
    from treespec import gqa_attention, reference
    from treespec.heads import PromptLookup
    from treespec.linear_kernels import use_linear_kernel

    calls = []
    monkeypatch.setattr(gqa_attention, "native_attention",
                        lambda *args: calls.append(args[0].shape[2]) or native_attention(*args))
    target, tokenizer = reference.load("smollm2")
    ids = tokenizer("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", return_tensors="pt").input_ids  # prompt lookup finds its drafts
    out = generate(target, ids, drafter=PromptLookup(), tree=Tree.full(2, 3), max_new_tokens=20)
    assert calls and max(calls) > 1  # tree passes went through the native kernel
    use_linear_kernel(target, "torch")
    target.set_attn_implementation("sdpa")
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))

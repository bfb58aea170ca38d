"""In-place grouped-query attention (treespec/gqa_attention.py): the same bits as transformers' sdpa under tree
masks on torch's flash kernel, chosen by the loader for grouped CPU models only, and greedy tree decoding on it (with
the native few-query kernel where it builds: tests/core/test_few_query_attention.py) equal to transformers' greedy on
stock sdpa."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from treespec import Tree, generate
from treespec.gqa_attention import NAME, additive_once, sdpa_gqa_in_place, use_in_place_gqa
from treespec.heads import DraftModel
from treespec.reference import load
from treespec.train.checks.architectures import FAMILIES, build, draft_of, prompt
from treespec.train.checks.lossless import hf_greedy


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("queries", [1, 3, 8])
def test_the_same_bits_as_transformers_sdpa_under_a_mask(mask_dtype, queries):
    gen = torch.Generator().manual_seed(queries)
    heads, kv, keys, dim = 9, 3, 40, 16
    module = types.SimpleNamespace(num_key_value_groups=heads // kv, is_causal=True, training=False,
                                   treespec_native_attention=False)  # torch's flash kernel (the native one: next file)
    q = torch.randn(2, heads, queries, dim, generator=gen)
    k, v = torch.randn(2, kv, keys, dim, generator=gen), torch.randn(2, kv, keys, dim, generator=gen)
    seen = torch.rand(2, 1, queries, keys, generator=gen) > 0.3
    seen[..., 0] = True  # every query sees a key
    mask = seen if mask_dtype == torch.bool else torch.zeros(seen.shape).masked_fill(~seen, torch.finfo().min)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = sdpa_gqa_in_place(module, q, k, v, mask, scaling=0.25)
    assert got.shape == expected.shape == (2, queries, heads, dim)
    assert torch.equal(got, expected)


def test_a_bool_mask_is_converted_once_per_mask_and_again_when_it_changes():
    """Every layer of a pass gets the same bool mask: it is made additive once (the same tensor back), again for a
    new mask, a mask changed in place or another dtype, and always as SDPA would make it (0 where seen, −inf not)."""
    seen = torch.rand(1, 1, 4, 9, generator=torch.Generator().manual_seed(0)) > 0.4
    first = additive_once(seen, torch.float32)
    assert additive_once(seen, torch.float32) is first
    assert torch.equal(first, torch.where(seen, 0.0, float("-inf")))
    seen[..., 0] = ~seen[..., 0]  # in place: its version moves
    again = additive_once(seen, torch.float32)
    assert again is not first and torch.equal(again, torch.where(seen, 0.0, float("-inf")))
    assert additive_once(seen.clone(), torch.float32) is not again
    assert additive_once(seen, torch.float64).dtype == torch.float64


def test_the_loader_picks_it_for_grouped_cpu_models_only():
    smol = build("Llama")  # the matrix's tiny models have 2 query heads over 1 key/value head
    assert not use_in_place_gqa(smol)  # built on eager: only "sdpa" is switched
    smol.set_attn_implementation("sdpa")
    assert use_in_place_gqa(smol) and smol.config._attn_implementation == NAME
    assert not use_in_place_gqa(smol)  # already switched
    target, _ = load("target")  # 6 heads, 6 key/value heads: nothing to gain
    assert target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.no_sdpa], ids=lambda f: f.name)
def test_greedy_tree_decoding_on_it_equals_transformers_on_stock_sdpa(family):
    """The architecture matrix's families (sliding windows, interleaved layers, MoE): tree passes through the
    in-place kernel, sequential transformers through stock sdpa."""
    name = family.name
    stock = build(name)
    stock.set_attn_implementation("sdpa")
    expected = hf_greedy(stock, prompt(), 24)
    target = build(name)
    use_in_place_gqa(target)  # a family without grouped heads (GPT-2) keeps sdpa: then this checks nothing new
    out = generate(target, prompt(), drafter=DraftModel(draft_of(name)), tree=Tree.full(2, 2), max_new_tokens=24)
    assert torch.equal(out.sequences, expected)

"""Lean drafting (heads/drafting/lean.py): the decoder stack run layer by layer equals the stock base model's forward
(committed tokens and tree nodes, outputs and cache), the transposed projection equals nn.Linear, models the
lean path does not know fall back to the plain one, and every drafter proposes the same trees and decodes
the same tokens with the switch on and off."""

import copy

import pytest
import torch
from transformers import DynamicCache

from treespec import Tree, generate
from treespec.compat import cache_arg
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel
from treespec.heads.drafting.lean import LeanProjection, lean_decoder
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.eagle3 import Eagle3, Eagle3Model
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.linear_kernels import onednn_available, reordered_weight, use_linear_kernel
from treespec.train.checks.architectures import build, full_attention
from treespec.visibility import dense_mask

from tests.helpers import hf_greedy, perturbed, record_proposals, tiny_llama

LEAN_FAMILIES = ["Llama", "Qwen3", "Mistral", "Qwen2"]  # the last two once every layer attends fully


def lean_base(name):
    model = copy.deepcopy(build(name, seed=5))  # build() is cached: leave its model as other tests expect it
    if name in ("Mistral", "Qwen2"):
        model = full_attention(model)
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize("name", LEAN_FAMILIES)
def test_lean_decoder_equals_the_base_model(name):
    model = lean_base(name)
    base = model.base_model
    lean = lean_decoder(base, model.config)
    assert lean is not None
    gen = torch.Generator().manual_seed(0)
    embed = model.get_input_embeddings()
    prompt, more = torch.randint(0, 64, (1, 6), generator=gen), torch.randint(0, 64, (1, 3), generator=gen)
    nodes = torch.randint(0, 64, (1, 4), generator=gen)
    # a tree over the 4 nodes: 0 and 1 children of the cache's last token, 2 under 0, 3 under 2
    allowed = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([[9, 9, 10, 11]])
    mask = dense_mask(allowed, 9, dtype=model.dtype)
    plain, leaned = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        for ids, past, kwargs in ((prompt, 0, {}), (more, 6, {}),
                                  (nodes, 9, {"position_ids": positions, "attention_mask": mask})):
            want = base(inputs_embeds=embed(ids), **cache_arg(plain), use_cache=True, **kwargs).last_hidden_state
            got = lean(embed(ids), leaned, past, kwargs.get("position_ids"), kwargs.get("attention_mask"))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain.layers, leaned.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize("name", ["Gemma-3", "GPT-2", "Mistral", "Qwen2"])
def test_models_the_lean_path_does_not_know_take_the_plain_one(name):
    model = build(name, seed=5)  # Gemma scales embeddings, GPT-2 adds positions, windows need their masks
    assert lean_decoder(model.base_model, model.config) is None
    assert DraftModel(model)._decoder is None


def test_sequence_dependent_rotary_scaling_takes_the_plain_path():
    model = copy.deepcopy(build("Llama", seed=5))
    assert lean_decoder(model.base_model, model.config) is not None
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    assert lean_decoder(model.base_model, model.config) is None


def test_lean_projection_equals_linear():
    linear = torch.nn.Linear(16, 40, bias=True)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(LeanProjection.of(linear)(x), linear(x))
    linear.bias = None
    torch.testing.assert_close(LeanProjection.of(linear)(x), linear(x))
    # a block's positions after its root: a strided slice, as DFlash projects them
    torch.testing.assert_close(LeanProjection.of(linear)(x[:, 1:]), linear(x[:, 1:]))


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_lean_projection_shares_and_follows_the_reordered_weight():
    """On oneDNN the projection reads the layer's blocked copy (one copy with a few-row target layer), follows the
    weight when it changes in place, and a copy of the projection does not copy the layer."""
    linear = torch.nn.Linear(16, 40, bias=False)
    use_linear_kernel(linear, "fewrow")
    lean = LeanProjection.of(linear)
    assert lean.blocked
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(lean(x), linear(x))
        held = reordered_weight(linear)
        lean(x)
        assert reordered_weight(linear) is held  # the layer's copy, not a second one
        linear.weight.mul_(2.0)  # in place: the version counter moves
        torch.testing.assert_close(lean(x), linear(x))
        assert reordered_weight(linear) is not held
    twin = copy.deepcopy(lean)
    assert twin._holder() is twin  # its weight is its own now: it does not read the layer's copy
    with torch.no_grad():
        torch.testing.assert_close(twin(x), linear(x))


# -- the switch: the same proposals and tokens on and off -------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def drafters(target, kind, lean):
    torch.manual_seed(0)
    if kind == "draft":
        return DraftModel(perturbed(target, 0.3), lean=lean)
    if kind == "eagle":
        return Eagle(EagleModel(target).eval(), lean=lean)
    if kind == "medusa":  # heads sharing the target's lm_head: one projection for every depth
        return Medusa(MedusaHeads(32, 64, num_heads=3, lm_head=target.get_output_embeddings()), lean=lean)
    return Eagle3(Eagle3Model(target).eval(), lean=lean)


TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dyn": DynamicTree(10, 4, 2)}
CASES = [(kind, tree) for kind in ("draft", "eagle", "eagle3", "medusa") for tree in TREES
         if not (kind == "medusa" and tree == "dyn")]  # Medusa fills static trees only


@pytest.mark.parametrize(("kind", "tree_name"), CASES)
def test_lean_switch_gives_the_same_proposals_and_tokens(target, kind, tree_name):
    tree = TREES[tree_name]
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    runs = {}
    for lean in (False, True):
        drafter = drafters(target, kind, lean)
        lean_parts = getattr(drafter, "_decoder", None) if kind != "medusa" else drafter._shared
        assert (lean_parts is not None) == (lean and kind != "eagle3")
        seen = record_proposals(drafter)
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=24)
        runs[lean] = (out.sequences, [(p.tree.paths, p.tokens.tolist()) for _, _, p in seen])
    assert torch.equal(runs[True][0], hf_greedy(target, prompt, 24))
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1] == runs[False][1]

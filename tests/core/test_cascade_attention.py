"""Cascade attention (treespec/cascade.py): the tree queries over the cached prefix by a kernel without a mask,
over the tree block under the ancestor mask, merged by log-sum-exps. On the CPU the pure-torch kernel stands in
for flash-attn (treespec/attention_kernels.py: the same (out, lse) contract); the tests marked ``gpu`` run the
flash kernel itself and skip without CUDA and flash-attn."""

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from treespec import Tree, attention_kernels, generate, reference
from treespec.cascade import merge, padded_causal, tree_pass
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, load
from treespec.inputs import left_padded
from treespec.masks import additive, prefix_order

from tests.helpers import hf_greedy, perturbed, tiny_llama

TORCH = "treespec_cascade_torch"


def dense_reference(q, k, v, seen, scale):
    """Masked attention in float64, heads repeated (GQA): q [b, n, h, d], k/v [b, K, kv, d], seen [b or 1, n, K]."""
    g = q.shape[2] // k.shape[2]
    k, v = (t.double().repeat_interleave(g, dim=2) for t in (k, v))
    scores = torch.einsum("bnhd,bkhd->bhnk", q.double(), k) * scale
    p = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhnk,bkhd->bnhd", p, v)


def tree_case(batch=2, cached=37, heads=4, kv=2, dim=16, dtype=torch.float32, seed=0):
    """Random q, k, v of a pass over a 14-node tree after ``cached`` keys, the tree's ancestor matrix."""
    tree = Tree.full(2, 3)
    n = tree.num_nodes
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, dim, generator=g).to(dtype)
    k = (2 * torch.randn(batch, cached + n, kv, dim, generator=g)).to(dtype)  # peaked: the block matters
    v = torch.randn(batch, cached + n, kv, dim, generator=g).to(dtype)
    return q, k, v, tree.ancestors


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2), (4, 1)])
def test_cascade_equals_dense_masked_attention_float32(heads, kv):
    q, k, v, ancestors = tree_case(heads=heads, kv=kv)
    n, cached, scale = q.shape[1], k.shape[1] - q.shape[1], 0.3
    seen = torch.cat([torch.ones(n, cached, dtype=torch.bool), ancestors], dim=1)[None]  # [1, n, K]
    out = tree_pass(attention_kernels.torch_kernel, q, k, v, additive(ancestors), scale)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, seen, scale), atol=2e-6, rtol=1e-5)


def test_cascade_in_bf16_is_as_accurate_as_sdpa_in_bf16():
    """bf16 inputs: the cascade rounds twice (the kernel returns its part in bf16, as flash-attn does, and the merged
    output is cast to bf16), so its error against float64 attention is at most two bf16 half-ulps of the largest
    output (2⁻⁸ relative each: ≤ 2⁻⁷·max|out|), and at most twice sdpa's own bf16 error on the same inputs."""
    for seed in range(3):
        q, k, v, ancestors = tree_case(dtype=torch.bfloat16, heads=4, kv=2, seed=seed)
        n, cached, scale = q.shape[1], k.shape[1] - q.shape[1], 0.25
        seen = torch.cat([torch.ones(n, cached, dtype=torch.bool), ancestors], dim=1)[None]
        exact = dense_reference(q, k, v, seen, scale)
        out = tree_pass(attention_kernels.torch_kernel, q, k, v, additive(ancestors, dtype=torch.bfloat16), scale)
        cascade_error = (out.to(torch.bfloat16).double() - exact).abs().max().item()
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=seen[:, None], scale=scale,
            enable_gqa=True).transpose(1, 2)
        sdpa_error = (sdpa.double() - exact).abs().max().item()
        assert cascade_error <= 2 ** -7 * exact.abs().max().item(), (seed, cascade_error)
        assert cascade_error <= 2 * sdpa_error, (seed, cascade_error, sdpa_error)


def test_merge_takes_flash_attns_infinite_lse_for_no_keys():
    """flash-attn returns lse = +inf (and out 0) for a query that saw no key, the torch kernel −inf: both weigh 0."""
    o1, o2 = torch.zeros(1, 2, 1, 3), torch.randn(1, 2, 1, 3)
    lse2 = torch.tensor([[[0.5, -2.0]]])
    for empty in (float("inf"), float("-inf")):
        out, lse = merge(o1, torch.full((1, 1, 2), empty), o2, lse2)
        torch.testing.assert_close(out, o2)
        torch.testing.assert_close(lse, lse2)
    half, _ = merge(o1, lse2, o2, lse2)  # equal weights: the mean
    torch.testing.assert_close(half, o2 / 2)


def test_ragged_rows_read_their_valid_keys_in_order():
    """A batch whose rows hold different cache slots (left padding, holes): each row's valid keys are gathered to
    the front and the kernel reads them up to the row's count; equal to dense attention under the full mask."""
    q, k, v, ancestors = tree_case(batch=3, cached=20, heads=4, kv=2)
    n, cached, scale = q.shape[1], 20, 0.3
    valid = torch.rand(3, cached, generator=torch.Generator().manual_seed(5)) > 0.4  # holes anywhere
    valid[:, -1] = True
    valid[0] = True
    counts = valid.sum(-1).tolist()
    seen = torch.cat([valid[:, None].expand(3, n, cached), ancestors.expand(3, n, n)], dim=2)
    out = tree_pass(attention_kernels.torch_kernel, q, k, v, additive(ancestors), scale, prefix_order(valid, counts))
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, seen, scale), atol=2e-6, rtol=1e-5)


def test_padded_prefill_matches_masked_attention_where_it_counts():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8,
                                                                                                     generator=g)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    out = padded_causal(q, k, v, padding, 0.5)  # [b, n, h, d]
    seen = torch.ones(6, 6, dtype=torch.bool).tril()[None] & padding.bool()[:, None]
    exact = dense_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), seen, 0.5)
    torch.testing.assert_close(out[0, 2:].double(), exact[0, 2:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), exact[1], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()  # a padding query sees itself: no NaN reaches the cache


# -- decoding: greedy output equals vanilla greedy ---------------------------------------------------------------
@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the torch kernel's calls by kind: causal (prefill, chains), prefix (tree passes, unmasked), ragged."""
    calls = {"causal": 0, "prefix": 0, "ragged": 0}
    inner = attention_kernels.torch_kernel

    def counted(q, k, v, causal, scale, key_lengths=None):
        calls["causal" if causal else "ragged" if key_lengths is not None else "prefix"] += 1
        return inner(q, k, v, causal, scale, key_lengths)

    monkeypatch.setitem(attention_kernels.KERNELS, "torch", counted)
    return calls


@pytest.fixture(scope="module")
def reference_models():
    target, tokenizer = reference.load("target")
    cascade, _ = reference.load("target", attn_implementation=TORCH)
    return target, cascade, tokenizer


@pytest.mark.parametrize("tree", [Tree.full(2, 3), DynamicTree(16, 5, 4)], ids=["static", "dynamic"])
def test_greedy_with_eagle_equals_vanilla_on_the_reference_target(reference_models, kernel_calls, tree):
    target, cascade, tokenizer = reference_models
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    out = generate(cascade, ids, drafter=load("reference:eagle", cascade), tree=tree, max_new_tokens=40)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 40))  # transformers' greedy, sdpa
    assert out.mean_accept_length > 1.5
    layers = cascade.config.num_hidden_layers
    # the prefill and every pass call the kernel once per layer; every tree pass over the prefix unmasked (the
    # last pass may be a plain one: the tree is cut to the tokens left)
    assert kernel_calls["prefix"] + kernel_calls["causal"] == (out.passes + 1) * layers
    assert kernel_calls["prefix"] >= (out.passes - 1) * layers


def test_batched_greedy_equals_transformers_batched_greedy(reference_models, kernel_calls):
    """Left-padded prompts whose rows then accept different lengths: the ragged path (valid keys gathered)."""
    target, cascade, tokenizer = reference_models
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\ndef main():\n", "class Stack:\n"]
    ids, mask = left_padded([tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts], 1)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=1)
    out = generate(cascade, ids, attention_mask=mask, drafter=load("reference:eagle", cascade), tree=Tree.full(2, 2),
                   max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert kernel_calls["ragged"] > 0


def gqa_llama(attn):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.2, attn_implementation=attn, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 3)], ids=["chain", "tree"])
def test_gqa_greedy_equals_transformers(kernel_calls, tree):
    target, cascade = gqa_llama("sdpa"), gqa_llama(TORCH)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    out = generate(cascade, prompt, drafter=DraftModel(perturbed(target, 0.1)), tree=tree, max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    assert kernel_calls["prefix" if not tree.is_chain else "causal"] > 0


# -- what it refuses ---------------------------------------------------------------------------------------------
def test_unsupported_features_are_refused_by_name():
    fn = AttentionInterface()[TORCH]
    module = torch.nn.Module()
    q = k = v = torch.zeros(1, 2, 3, 8)
    for kwargs, match in (({"dropout": 0.1}, "no dropout"), ({"softcap": 50.0}, "soft-capping"),
                          ({"sliding_window": 4}, "sliding windows"), ({"s_aux": torch.zeros(2)}, "sinks"),
                          ({"is_causal": False}, "causal decoders")):
        with pytest.raises(ValueError, match=match):
            fn(module, q, k, v, None, **kwargs)
    with pytest.raises(ValueError, match="fits neither"):
        fn(module, q, k, v, torch.zeros(1, 1, 3, 2))
    mistral = tiny_llama(attn=TORCH)
    mistral.config.sliding_window, mistral.config.layer_types = 4, ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="no sliding windows"):
        generate(mistral, torch.tensor([[1, 2, 3]]), max_new_tokens=2)


@pytest.mark.skipif(attention_kernels.flash_available(), reason="flash-attn is installed here")
def test_the_flash_kernel_without_flash_attn_says_how_to_get_it():
    model = tiny_llama(attn="treespec_cascade")
    with pytest.raises(ValueError, match=r"treespec\[flash\].*treespec_cascade_torch"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    with pytest.raises(ImportError, match=r"treespec\[flash\]"):
        attention_kernels.flash_kernel(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8),
                                       False, 1.0)


# -- the flash kernel itself (CUDA, flash-attn) ------------------------------------------------------------------
needs_flash = pytest.mark.skipif(not torch.cuda.is_available() or not attention_kernels.flash_available(),
                                 reason="needs CUDA and flash-attn")


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("ragged", [False, True])
def test_flash_kernel_keeps_the_torch_kernels_contract(ragged):
    """Out and log-sum-exp of flash-attn against the stand-in, bf16, GQA, causal or not, with per-row lengths."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, s, h, 64, generator=g).cuda().bfloat16() for s, h in ((14, 8), (300, 2), (300, 2)))
    lengths = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda") if ragged else None
    for causal in (False, True) if not ragged else (False,):
        out, lse = attention_kernels.flash_kernel(q, k, v, causal, 0.125, lengths)
        ref_out, ref_lse = attention_kernels.torch_kernel(q, k, v, causal, 0.125, lengths)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_flash
def test_flash_cascade_greedy_equals_its_own_vanilla_on_cuda():
    cpu = tiny_llama(attn="treespec_cascade")
    draft = perturbed(cpu, 0.1).to("cuda", torch.bfloat16)
    target = cpu.to("cuda", torch.bfloat16)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3)).cuda()
    expected = hf_greedy(target, prompt, 24)  # transformers' greedy through the same attention (causal flash)
    for tree in (Tree.full(2, 3), Tree.chain(3)):
        out = generate(target, prompt, drafter=DraftModel(draft), tree=tree, max_new_tokens=24)
        assert torch.equal(out.sequences, expected), tree


@pytest.mark.parametrize("batch", [1, 3])
def test_cascade_adds_no_host_read(batch):
    """The ragged batch's key order comes from counts the host keeps, the kernel's lengths are an upload: a step
    still reads back once (treespec/host_reads.py), as under sdpa."""
    from treespec.host_reads import reads_per_step

    gen = torch.Generator().manual_seed(0)
    ids, mask = left_padded([torch.randint(0, 64, (n,), generator=gen) for n in (9, 4, 13)[:batch]], 0)
    counts = {}
    for attn in ("sdpa", TORCH):
        target = tiny_llama(seed=1, attn=attn)
        counts[attn] = reads_per_step(target, ids, attention_mask=mask if batch > 1 else None,
                                      drafter=DraftModel(perturbed(target, 0.3)), tree=Tree.full(2, 2),
                                      max_new_tokens=8)["device"]
    assert counts[TORCH] == counts["sdpa"] <= 1, counts

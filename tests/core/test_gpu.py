"""The accelerator path: greedy equality and lossless sampling with every tensor on the device, in fp32 and
bf16, under sdpa, eager and flex_attention. Marked ``gpu``: skipped without CUDA. ``scripts/gpu_check.sh``
runs it on a GPU; ``TREESPEC_TEST_DEVICE=cpu`` runs the same code on the CPU (its dry run, in CI)."""

import os

import numpy as np
import pytest
import torch

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import (
    Combined,
    DraftModel,
    Eagle,
    EagleModel,
    Lookahead,
    PromptLookup,
    Rest,
    SuffixDecoding,
    TokenRecycling,
)
from treespec.heads.rest import SuffixArray
from treespec.sampling import Sampling

from tests.helpers import PROMPT, VOCAB, chi2_pvalue, exact_distribution, hf_greedy, perturbed, tiny_llama

DEVICE = os.environ.get("TREESPEC_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
# the CPU dry run only exercises the code path; on CUDA the chi-square test runs at full strength
RUNS = 2000 if DEVICE == "cuda" else 300
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 4, 3)}


def on_device(model, dtype=torch.float32):
    return model.to(device=DEVICE, dtype=dtype).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_equals_transformers_on_device(attn, tree_name):
    if attn == "flex_attention" and DEVICE == "cpu":
        pytest.skip("flex_attention needs CUDA: torch 2.13's inductor fails on CPU (generate refuses it there)")
    target = on_device(tiny_llama(seed=0, attn=attn))
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    drafter = DraftModel(perturbed(target, 0.1)) if tree_name != "dynamic" else Eagle(EagleModel(target))
    out = generate(target, prompt, drafter=drafter, tree=TREES[tree_name], max_new_tokens=24)
    assert out.sequences.device.type == torch.device(DEVICE).type
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_batched_greedy_equals_transformers_on_device(attn):
    """A left-padded batch (ragged rows: per-row masks, a BlockMask over the rows under flex_attention)."""
    if attn == "flex_attention" and DEVICE == "cpu":
        pytest.skip("flex_attention needs CUDA: torch 2.13's inductor fails on CPU (generate refuses it there)")
    from treespec.inputs import left_padded

    target = on_device(tiny_llama(seed=0, attn=attn))
    gen = torch.Generator().manual_seed(3)
    ids, mask = left_padded([torch.randint(0, 64, (n,), generator=gen) for n in (3, 17, 9, 1)], 0)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    for drafter, tree in ((DraftModel(perturbed(target, 0.1)), Tree.full(2, 2)),
                          (Eagle(EagleModel(target)), DynamicTree(8, 4, 3))):
        out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=tree, max_new_tokens=20)
        assert torch.equal(out.sequences, expected), (type(drafter).__name__, tree)


@pytest.mark.parametrize("name", ["recycling", "suffix", "rest", "lookahead", "combined"])
def test_model_free_greedy_on_device(name):
    """Token Recycling's matrix lives on the device (its update and read never leave it), SuffixDecoding's tries
    and REST's suffix array on the host, Lookahead's window on the host fed by the device's argmax; each, and two
    combined, equal transformers' greedy with the target on the device."""
    target = on_device(tiny_llama(seed=0))
    stream = np.array([5, 9, 13, 2, 7] * 4 + [-1] + list(range(64)), dtype=np.int32)  # -1: a document's end
    drafter = {"recycling": TokenRecycling, "suffix": SuffixDecoding,
               "rest": lambda: Rest(SuffixArray.build(stream), min_match=1), "lookahead": Lookahead,
               "combined": lambda: Combined([TokenRecycling(), SuffixDecoding()])}[name]()
    for prompt in (torch.tensor([[5, 9, 13, 2, 7] * 3]), torch.randint(0, 64, (1, 9), generator=torch.Generator(
            ).manual_seed(3))):
        prompt = prompt.to(DEVICE)
        out = generate(target, prompt, drafter=drafter, tree=Tree.full(2, 2) if name in ("suffix", "rest") else None,
                       max_new_tokens=24)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    if name == "recycling":
        assert drafter.matrix.device.type == torch.device(DEVICE).type


def test_bf16_greedy_equals_transformers_bf16():
    target = on_device(tiny_llama(seed=0), torch.bfloat16)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = generate(target, prompt, drafter=DraftModel(perturbed(target, 0.1)), tree=Tree.full(2, 2), max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 16))


@pytest.mark.parametrize("drafter_name", ["draft-sampled", "prompt-lookup"])
@pytest.mark.parametrize("generator_on", ["cpu", "device"])
def test_sampling_is_lossless_on_device(drafter_name, generator_on):
    target = on_device(tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1))
    drafter = DraftModel(perturbed(target, 1.0), candidates="sample") if drafter_name == "draft-sampled" \
        else PromptLookup()
    # every draw (root, candidates, the walk's uniforms) is made on the generator's own device
    gen = torch.Generator(device="cpu" if generator_on == "cpu" else DEVICE).manual_seed(0)
    sampling = Sampling(1.0)
    counts = np.zeros((VOCAB,) * 3)
    for _ in range(RUNS):
        out = generate(target, PROMPT.to(DEVICE), drafter=drafter, tree=Tree.full(2, 2), max_new_tokens=3,
                       temperature=1.0, generator=gen)
        counts[tuple(out.sequences[0, PROMPT.shape[1]:].tolist())] += 1
    assert chi2_pvalue(counts, exact_distribution(target, sampling)) > 1e-3


@pytest.mark.parametrize("tree_name", ["chain", "full", "dynamic"])
def test_compiled_static_steps_on_device(tree_name):
    """generate(compile=True): CUDA graphs (mode="reduce-overhead") on the device, the eager backend in the CPU dry
    run; greedy output equals transformers', and a second run compiles no new graph (treespec/static_pass.py)."""
    from torch._dynamo.utils import counters

    target = on_device(tiny_llama(seed=0))
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    compile_with = True if DEVICE == "cuda" else {"backend": "eager"}

    def drafter():
        return DraftModel(perturbed(target, 0.1)) if tree_name != "dynamic" else Eagle(EagleModel(target))

    out = generate(target, prompt, drafter=drafter(), tree=TREES[tree_name], max_new_tokens=24, compile=compile_with)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    graphs = counters["stats"]["unique_graphs"]
    again = generate(target, prompt, drafter=drafter(), tree=TREES[tree_name], max_new_tokens=24, compile=compile_with)
    assert torch.equal(again.sequences, out.sequences) and counters["stats"]["unique_graphs"] == graphs

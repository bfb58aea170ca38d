"""Batches: every row of generate() on a left-padded batch equals transformers' batched greedy generate on the
same batch (prompts of very different lengths, rows ending at different steps), for every drafter and tree
shape; each drafter's batched cache stays in sync row by row when rows accept different lengths; sampling is
lossless per row; finished rows leave the batch; a batch of one is the single-prompt path."""

import random

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, registry
from treespec.heads.eagle import Eagle
from treespec.heads.eagle3 import Eagle3
from treespec.sampling import Sampling
from treespec.train.checks.architectures import build, full_attention
from treespec.walker import row_by_row

from tests.helpers import (
    BATCH_DRAFTERS,
    BATCH_LENGTHS,
    ROW_PROMPTS,
    ROW_VOCAB,
    STATIC_ONLY,
    accept_everything,
    batch,
    chi2_pvalue,
    exact_row_distribution,
    hf_batch_greedy,
    perturbed,
    random_eagle,
    random_eagle3,
    sampled_rows,
    scratch_logits,
    scratch_proposal,
    tiny_llama,
)

TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 2)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=0)  # 4 layers: EAGLE-3's distinct aux layers


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("drafter_name", list(BATCH_DRAFTERS))
def test_every_row_equals_transformers_batched_greedy(target, drafter_name, tree_name):
    if drafter_name in STATIC_ONLY and tree_name == "dynamic":
        pytest.skip("grows no dynamic trees")
    ids, mask = batch()
    expected = hf_batch_greedy(target, ids, mask, 24)
    out = generate(target, ids, attention_mask=mask, drafter=BATCH_DRAFTERS[drafter_name](target),
                   tree=TREES[tree_name], max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert [row.new_tokens for row in out.rows] == [24] * len(BATCH_LENGTHS)
    assert all(sum(row.accept_lengths) == 24 - 1 for row in out.rows)  # each row's prefill commits its first token


def test_rows_accept_different_lengths_and_end_at_different_steps(target):
    ids, mask = batch()
    reference_run = hf_batch_greedy(target, ids, mask, 24)
    eos = int(reference_run[1, ids.shape[1] + 5])  # row 1 ends at its 6th token; others whenever they emit it
    expected = hf_batch_greedy(target, ids, mask, 24, eos=eos)
    for tree in TREES.values():
        out = generate(target, ids, attention_mask=mask, drafter=DraftModel(perturbed(target, 0.1)), tree=tree,
                       max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out.sequences, expected)
        ends = [row.new_tokens for row in out.rows]
        assert ends[1] == 6 and len(set(ends)) > 1
        assert len({tuple(row.accept_lengths) for row in out.rows}) > 1  # ragged acceptance was exercised


@pytest.mark.parametrize("family", ["Qwen3", "GPT-2", "OLMo-2"])
def test_other_families(family):
    model = build(family).eval()
    model.set_attn_implementation("sdpa")
    ids, mask = batch()
    expected = hf_batch_greedy(model, ids, mask, 20)
    for tree in (Tree.chain(3), Tree.full(2, 2), DynamicTree(8, 3, 2)):
        out = generate(model, ids, attention_mask=mask, drafter=DraftModel(full_attention(perturbed(model, 0.1))),
                       tree=tree, max_new_tokens=20)
        assert torch.equal(out.sequences, expected), (family, tree)


@pytest.fixture(scope="module")
def reference_batch():
    target, tokenizer = reference.load("target")
    tokenizer.padding_side = "left"
    prompts = [p[: n] for p, n in zip(reference.prompts()[:4], (400, 40, 160, 12), strict=True)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    return target, encoded.input_ids, encoded.attention_mask, tokenizer.pad_token_id


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft", "medusa", "prompt_lookup", "recycling", "suffix"])
def test_reference_models_batched(reference_batch, kind):
    target, ids, mask, pad = reference_batch
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=pad)
    source = f"reference:{kind}" if registry.get(kind).has_weights else None
    drafter = registry.build(kind, target, source)
    trees = [Tree.chain(3), Tree.full(2, 2)] + ([DynamicTree(16, 5, 4)] if drafter.grows_dynamic_trees else [])
    for tree in trees:
        out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=tree, max_new_tokens=24,
                       pad_token_id=pad)
        assert torch.equal(out.sequences, expected), (kind, tree)
        if kind in ("eagle", "eagle3"):  # trained drafters: long, row-dependent acceptance
            assert out.mean_accept_length > 1.5


# -- each drafter's batched cache stays in sync when rows accept different lengths -------------------------
def ragged_walker(seed=0):
    """A stand-in walker that accepts a random prefix of the deepest path, whatever the target says, so that
    rows of one batch keep different numbers of nodes every step (holes in every cache)."""
    from treespec.walker import Walk

    rng = random.Random(seed)

    def walk(logits, proposal, sampling, **kwargs):
        tree = proposal.tree
        deepest = max(tree.leaf_paths, key=len) if len(tree) else []
        path = torch.tensor(deepest[: rng.randint(0, len(deepest))], dtype=torch.long)
        return Walk(path=path, next_token=int(logits[int(path[-1]) if len(path) else 0].argmax()))

    return walk


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2), DynamicTree(8, 3, 2)], ids=["chain", "full", "dyn"])
@pytest.mark.parametrize("kind", ["draft", "eagle", "eagle3"])
def test_batched_proposals_match_recomputation_per_row(target, kind, tree, monkeypatch):
    import importlib

    from tests.helpers import record_proposals

    drafter = {"draft": lambda: DraftModel(perturbed(target, 0.3)), "eagle": lambda: Eagle(random_eagle(target)),
               "eagle3": lambda: Eagle3(random_eagle3(target, draft_vocab=24))}[kind]()
    seen = record_proposals(drafter)
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(ragged_walker()))
    ids, mask = batch()
    out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=tree, max_new_tokens=16)
    assert len({tuple(row.accept_lengths) for row in out.rows}) > 1
    with torch.no_grad():
        for committed, step_tree, proposal in seen:
            got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
            assert got == scratch_proposal(scratch_logits(drafter, target, committed), step_tree)


def test_finished_rows_leave_the_batch(target):
    ids, mask = batch()
    eos = int(hf_batch_greedy(target, ids, mask, 24)[0, ids.shape[1] + 2])
    drafter = DraftModel(perturbed(target, 0.1))
    kept, sizes = [], []
    keep_rows, propose = drafter.keep_rows, drafter.propose

    def recording_keep(rows):
        kept.append(rows.tolist())
        keep_rows(rows)

    def recording_propose(committed, *args):
        sizes.append(len(committed.lengths))
        if drafter.slots is not None:  # the drafter's cache holds the rows still decoding, no more
            assert drafter.cache.layers[0].keys.shape[0] == drafter.slots.batch == len(committed.lengths)
        return propose(committed, *args)

    drafter.keep_rows, drafter.propose = recording_keep, recording_propose
    out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=Tree.chain(3), max_new_tokens=24,
                   eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, hf_batch_greedy(target, ids, mask, 24, eos=eos))
    assert kept and sizes[0] == len(BATCH_LENGTHS) and sizes[-1] < sizes[0] and sizes == sorted(sizes, reverse=True)


def test_inputs_list_of_prompts_and_refusals(target):
    ids, mask = batch()
    prompts = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    explicit = generate(target, ids, attention_mask=mask, max_new_tokens=8)
    listed = generate(target, prompts, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(listed.sequences, explicit.sequences) and listed.batch_size == len(BATCH_LENGTHS)
    assert explicit.target_passes == 7 and explicit.new_tokens == 8 * len(BATCH_LENGTHS)
    # one prompt given as a batch of one (or with padding) is the single-prompt path
    single = generate(target, prompts[1][None], max_new_tokens=8)
    padded = generate(target, ids[1:2], attention_mask=mask[1:2], max_new_tokens=8)
    assert torch.equal(padded.sequences[:, -9:], single.sequences[:, -9:])
    assert torch.equal(single.sequences[0], explicit.sequences[1, ids.shape[1] - BATCH_LENGTHS[1] :])
    assert single.rows[0].accept_lengths == single.accept_lengths
    with pytest.raises(ValueError, match="pads on the right"):
        generate(target, ids, attention_mask=mask.flip(-1), max_new_tokens=4)
    with pytest.raises(ValueError, match="masks the whole prompt"):
        generate(target, ids, attention_mask=mask * torch.tensor([[1], [1], [0], [1]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="sliding-window layers"):
        generate(build("Mistral"), ids, attention_mask=mask, max_new_tokens=4)


# -- sampling: each row's continuation is distributed as the target's alone --------------------------------
@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=ROW_VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)


CASES = {
    "tree-sampled": (lambda t: DraftModel(perturbed(t, 1.0), candidates="sample"), Tree.full(2, 2)),
    "tree-topk": (lambda t: DraftModel(perturbed(t, 1.0)), Tree.full(2, 2)),
    "eagle-dynamic": (lambda t: Eagle(random_eagle(t)), DynamicTree(5, 2, 2)),
}


# top-k candidates per row run with -m slow (the dynamic tree already verifies deterministic siblings per row)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "tree-topk" else c for c in CASES])
def test_sampling_is_lossless_per_row(small, case):
    make, tree = CASES[case]
    sampling = Sampling(1.0)
    for prompt, counts in zip(ROW_PROMPTS, sampled_rows(small, make(small), tree, sampling), strict=True):
        assert chi2_pvalue(counts, exact_row_distribution(small, prompt, sampling)) > 1e-3


def test_wrong_acceptance_is_detected_per_row(small, monkeypatch):
    """Negative control: accepting every drafted token (ignoring p_target) fails the same test."""
    import importlib

    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_rows(small, DraftModel(perturbed(small, 1.0)), Tree.chain(2), sampling)
    assert all(chi2_pvalue(c, exact_row_distribution(small, p, sampling)) < 1e-3 for p, c in zip(ROW_PROMPTS, counts,
                                                                                                   strict=True))

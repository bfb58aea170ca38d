"""A tree per batch size (treespec/batch_trees.py): the table's lookup, its checks at generate()'s door, and
decoding that follows it as rows finish: every row still equals transformers' batched greedy generate when the
batch drafts, pauses (no tree at that many rows) and drafts again (the drafter starts over from the committed
tokens and their kept features: generate.resume_drafter), for every drafter; sampled rows still follow the
target's distribution, and the negative control fails."""

import importlib

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.batch_trees import TreesByBatch
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, DFlash, DraftModel, PromptLookup, registry
from treespec.sampling import Sampling
from treespec.walker import row_by_row

from tests.helpers import (
    BATCH_DRAFTERS,
    ROW_PROMPTS,
    ROW_VOCAB,
    STATIC_ONLY,
    accept_everything,
    batch,
    chi2_pvalue,
    exact_row_distribution,
    hf_batch_greedy,
    perturbed,
    random_dflash,
    sampled_rows,
    tiny_llama,
)

LENGTHS = (3, 17, 9, 1, 5)


def test_the_table_takes_the_next_larger_size():
    table = TreesByBatch({4: Tree.chain(2), 1: Tree.chain(4), 16: Tree.chain(0)})
    assert table.sizes == [1, 4, 16]
    assert [table.at(b) for b in (1, 2, 4, 5, 16, 40)] == [Tree.chain(4), Tree.chain(2), Tree.chain(2),
                                                           Tree.chain(0), Tree.chain(0), Tree.chain(0)]
    assert table.speculates and table.pauses and table.depth == 4 and len(table) == 4
    assert not TreesByBatch({1: Tree.chain(0)}).speculates
    assert not TreesByBatch({1: Tree.chain(3), 8: DynamicTree(8, 3, 2)}).pauses
    for bad, match in (({}, "at least one entry"), ({0: Tree.chain(1)}, "integers >= 1"),
                       ({2: {"kind": "chain", "depth": 2}}, "must be a Tree or a DynamicTree")):
        with pytest.raises(ValueError, match=match):
            TreesByBatch(bad)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=0)


def test_refusals_name_the_size(target):
    ids, mask = batch()
    with pytest.raises(ValueError, match="at batch size 2: .*cannot grow DynamicTree"):
        generate(target, ids, attention_mask=mask, drafter=registry.build("prompt_lookup", target),
                 tree=TreesByBatch({1: Tree.chain(2), 2: DynamicTree(8, 3, 2)}), max_new_tokens=4)
    with pytest.raises(ValueError, match="has candidates but no drafter"):
        generate(target, ids, attention_mask=mask, tree=TreesByBatch({1: Tree.chain(2)}), max_new_tokens=4)
    # a table that never drafts is vanilla decoding, with or without a drafter
    out = generate(target, ids, attention_mask=mask, tree=TreesByBatch({1: Tree.chain(0)}), max_new_tokens=6)
    assert torch.equal(out.sequences, hf_batch_greedy(target, ids, mask, 6))


def counting_resumes(monkeypatch) -> list[int]:
    """Count generate.resume_drafter's calls (each the rows it restarted)."""
    loop = importlib.import_module("treespec.generate")
    calls, resume = [], loop.resume_drafter

    def counted(run, rows):
        calls.append(len(rows))
        resume(run, rows)

    monkeypatch.setattr(loop, "resume_drafter", counted)
    return calls


def ending_batch(model, new: int):
    """A 5-row batch whose rows end one at a time (eos tokens that rows 1, 2 and 3 emit at their 5th, 10th and 15th
    token; with this model row 4 meets one at its 4th, row 0 none), and the reference output."""
    ids, mask = batch(LENGTHS)
    first = hf_batch_greedy(model, ids, mask, new)[:, ids.shape[1]:]
    eos = [int(first[row, at]) for row, at in ((1, 4), (2, 9), (3, 14))]
    return ids, mask, eos, hf_batch_greedy(model, ids, mask, new, eos=eos)


def tables(dynamic: bool) -> dict[str, TreesByBatch]:
    tree = DynamicTree(8, 3, 2) if dynamic else Tree.full(2, 2)
    return {
        # drafts with all rows, pauses at 2-4 rows, drafts again for the last one (resume)
        "draft-pause-draft": TreesByBatch({1: Tree.chain(3), 4: Tree.chain(0), 8: tree}),
        # vanilla while more than one row is left, then drafts (resume from the prefill's features on)
        "vanilla-then-draft": TreesByBatch({1: tree, 2: Tree.chain(0)}),
    }


# beside the batch tests' drafters: a block drafter and a Combined (their own state, started over on a resume)
DRAFTERS = {**BATCH_DRAFTERS, "dflash": lambda t: DFlash(random_dflash(t)),
            "combined": lambda t: Combined([PromptLookup(max_ngram=2), DraftModel(perturbed(t, 0.1))])}


@pytest.mark.parametrize("table", ["draft-pause-draft", "vanilla-then-draft"])
@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
def test_rows_equal_transformers_batched_greedy_as_the_table_changes(target, drafter_name, table, monkeypatch):
    resumes = counting_resumes(monkeypatch)
    ids, mask, eos, expected = ending_batch(target, 20)
    trees = tables(drafter_name not in STATIC_ONLY | {"combined"})[table]
    out = generate(target, ids, attention_mask=mask, drafter=DRAFTERS[drafter_name](target), tree=trees,
                   max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    ends = [row.new_tokens for row in out.rows]
    assert ends[1] == 5 and len(set(ends)) == len(ends)  # one at a time: the table's every size is met
    assert resumes and resumes[-1] == 1  # the drafter started again for the last row
    if drafter_name == "draft":  # a drafter that agrees often: after its restart its proposals are accepted
        assert max(out.rows[ends.index(max(ends))].accept_lengths[-2:]) > 1


@pytest.fixture(scope="module")
def reference_rows():
    target, tokenizer = reference.load("target")
    tokenizer.padding_side = "left"
    prompts = [p[: n] for p, n in zip(reference.prompts()[:3], (300, 40, 120), strict=True)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    return target, encoded.input_ids, encoded.attention_mask, tokenizer.pad_token_id


KINDS = ["eagle", "eagle3", "draft", "medusa", "hydra", "prompt_lookup", "recycling", "suffix", "lookahead", "rest"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_drafts_again_after_a_pause(reference_rows, kind, monkeypatch):
    """Each kind of the registry, on the reference target: a batch of 3 with different budgets' worth of eos, drafting
    at 3 rows, vanilla at 2, drafting again at 1."""
    target, ids, mask, pad = reference_rows
    resumes = counting_resumes(monkeypatch)
    first = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=pad)
    eos = int(first[1, ids.shape[1] + 3])  # row 1 ends early
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=pad,
                               eos_token_id=eos)
    source = f"reference:{kind}" if registry.get(kind).has_weights else None
    drafter = registry.build(kind, target, source)
    table = TreesByBatch({1: Tree.chain(3), 2: Tree.chain(0), 3: Tree.full(2, 2)})
    out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=table, max_new_tokens=24,
                   eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(out.sequences, expected), kind
    ends = sorted(row.new_tokens for row in out.rows)
    if ends[0] < ends[1] < ends[2]:  # rows left one at a time: 3 → 2 (pause) → 1 (resume)
        assert resumes == [1]


# -- sampling: a table's steps are lossless steps, whatever each proposes ---------------------------------------
@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=ROW_VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)


# 30 rows: all of them draft, then the rows left after the first pass decode without a tree
SAMPLED_TABLE = TreesByBatch({29: Tree.chain(0), 30: Tree.full(2, 2)})


def test_sampling_is_lossless_per_row_as_the_table_changes(small):
    sampling = Sampling(1.0)
    counts = sampled_rows(small, DraftModel(perturbed(small, 1.0), candidates="sample"), SAMPLED_TABLE, sampling)
    for prompt, c in zip(ROW_PROMPTS, counts, strict=True):
        assert chi2_pvalue(c, exact_row_distribution(small, prompt, sampling)) > 1e-3


def test_wrong_acceptance_is_detected_with_a_table(small, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_rows(small, DraftModel(perturbed(small, 1.0)), SAMPLED_TABLE, sampling)
    assert all(chi2_pvalue(c, exact_row_distribution(small, p, sampling)) < 1e-3
               for p, c in zip(ROW_PROMPTS, counts, strict=True))

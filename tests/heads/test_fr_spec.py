"""FR-Spec: a drafter's lm_head restricted to a frequency-ranked subset of the target vocabulary (no
retraining) stays lossless, greedy and sampled; proposals never leave the subset."""

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.heads import DraftModel, registry
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.planning.autotree import EngineCost
from treespec.sampling import Sampling
from treespec.train.compare import setup_costs
from treespec.train.compare.categories import make_line
from treespec.train.compare.job import run_from_config
from treespec.train.training import data

from tests.helpers import (
    VOCAB,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    perturbed,
    record_proposals,
    sampled_counts,
    tiny_llama,
)

FR_RUNS = 1500  # enough to fail the negative control of test_lossless by a wide margin at this table size


def test_most_frequent_keeps_the_top_counts_in_id_order():
    vocab = DraftVocab.most_frequent(torch.tensor([5, 1, 9, 9, 0, 3]), 3)
    assert vocab.ids.tolist() == [0, 2, 3] and vocab.d2t.tolist() == [0, 1, 1]
    assert vocab.t2d.tolist() == [True, False, True, True, False, False]
    assert DraftVocab.from_maps(vocab.d2t, vocab.t2d).ids.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="draft vocabulary size must be in 1..6"):
        DraftVocab.most_frequent(torch.ones(6), 7)


def test_reduced_head_equals_the_full_head_on_the_subset():
    head = torch.nn.Linear(8, 10, bias=False)
    vocab = DraftVocab(torch.tensor([1, 4, 7]), 10)
    hidden = torch.randn(2, 3, 8)
    reduced, full = ReducedHead(head, vocab)(hidden), head(hidden)
    assert torch.allclose(reduced[..., vocab.ids], full[..., vocab.ids])
    assert torch.isinf(reduced[..., [0, 2, 3, 5, 6, 8, 9]]).all()
    with pytest.raises(ValueError, match="bias-free"):
        ReducedHead(torch.nn.Linear(8, 10), vocab)


def test_round_trip(tmp_path):
    vocab = DraftVocab(torch.tensor([0, 3, 5]), 8)
    vocab.save(tmp_path / "v.safetensors")
    back = DraftVocab.load(tmp_path / "v.safetensors")
    assert torch.equal(back.ids, vocab.ids) and back.vocab_size == 8


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2)], ids=["chain", "full"])
def test_draft_model_with_a_reduced_vocabulary_is_greedy_lossless(tree):
    target = tiny_llama(seed=0)
    vocab = DraftVocab.most_frequent(torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(0)), 24)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    drafter = DraftModel(perturbed(target, 0.1), draft_vocab=vocab)
    seen = record_proposals(drafter)
    out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    assert seen and all(bool(vocab.t2d[p.tokens].all()) for _, _, p in seen)  # candidates stay in the subset


@pytest.mark.parametrize("candidates", ["sample", "topk"])
def test_draft_model_with_a_reduced_vocabulary_samples_losslessly(candidates):
    target = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    vocab = DraftVocab(torch.tensor([0, 1, 3]), VOCAB)  # token 2 can never be drafted, only emitted by the target
    drafter = DraftModel(perturbed(target, 1.0), candidates=candidates, draft_vocab=vocab)
    sampling = Sampling(1.0)
    counts = sampled_counts(target, drafter, Tree.full(2, 2), sampling, runs=FR_RUNS)
    assert counts[2].sum() > 0  # the target still emits the token the drafter cannot propose
    assert chi2_pvalue(counts, exact_distribution(target, sampling)) > 1e-3


def test_eagle_and_medusa_with_a_reduced_vocabulary_are_greedy_lossless():
    from treespec.dynamic_tree import DynamicTree
    from treespec.heads import Eagle, EagleModel, Medusa, MedusaHeads

    target = tiny_llama(seed=0)
    vocab = DraftVocab.most_frequent(torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(0)), 24)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    heads = MedusaHeads(32, 64, num_heads=2, share_lm_head=False, lm_head=target.get_output_embeddings())
    for drafter, tree in [(Eagle(EagleModel(target), draft_vocab=vocab), DynamicTree(8, 3, 2)),
                          (Medusa(heads, draft_vocab=vocab), Tree.full(2, 2))]:
        seen = record_proposals(drafter)
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=16)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 16))
        assert seen and all(bool(vocab.t2d[p.tokens].all()) for _, _, p in seen)


def test_eagle_with_a_reduced_vocabulary_samples_losslessly():
    from treespec.heads import Eagle, EagleModel

    target = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    torch.manual_seed(0)
    drafter = Eagle(EagleModel(target), candidates="sample", draft_vocab=DraftVocab(torch.tensor([0, 2, 3]), VOCAB))
    sampling = Sampling(1.0)
    counts = sampled_counts(target, drafter, Tree.full(2, 2), sampling, runs=FR_RUNS)
    assert chi2_pvalue(counts, exact_distribution(target, sampling)) > 1e-3


def test_registry_refuses_a_vocabulary_where_there_is_no_head():
    from treespec.heads import registry

    with pytest.raises(ValueError, match="no full-vocabulary head to restrict"):
        registry.make("prompt_lookup", None, draft_vocab=DraftVocab(torch.tensor([0, 1]), 4))


def test_a_comparison_keeps_the_vocabulary_an_fr_spec_entry_drafted_with(tmp_path, monkeypatch, no_report_figures):
    """conf/drafter/eagle_fr.yaml (draft_vocab: 2048) in the comparison: the run keeps the vocabulary it ranked
    (draft_vocab/eagle_fr.safetensors), records it, and results.md's line that makes the drafter again loads it. The
    setup's timing is stubbed."""
    monkeypatch.setattr(setup_costs, "measure_engine_cost", lambda target, **kw: EngineCost())
    monkeypatch.setattr(setup_costs, "measure_cost_curve", lambda target, sizes, **kw: {n: 1e-3 * n for n in sizes})
    monkeypatch.setattr(data, "STDLIB_CORPUS", {**data.STDLIB_CORPUS, "max_files": 12})
    cfg = compose_cfg("compare", ["drafters=[eagle_fr]", "prompts=1", "max_new_tokens=8", "cost_sizes=[1,2]",
                                  "peers=false", "assistant=null", "logger=none", "threads=1", "workload.held_out=1",
                                  "trees=[{kind: chain, depth: 2}]", f"paths.data={tmp_path / 'data'}"])
    result = run_from_config(cfg, tmp_path / "run")
    entry = result["drafter_entries"]["eagle_fr"]
    assert entry["draft_vocab"] == 2048 and entry["draft_vocab_file"] == "draft_vocab/eagle_fr.safetensors"
    kept = DraftVocab.load(tmp_path / "run" / entry["draft_vocab_file"])
    assert len(kept) == 2048
    line = make_line(entry, tmp_path / "run")
    assert line.startswith('registry.make("eagle", registry.load_module("eagle", target, "reference:eagle"), "topk", '
                           "DraftVocab.load(")
    target, _ = reference.load("target")
    drafter = eval(line, {"registry": registry, "DraftVocab": DraftVocab, "target": target})
    assert isinstance(drafter._logits, ReducedHead) and torch.equal(drafter._logits.vocab.ids, kept.ids)

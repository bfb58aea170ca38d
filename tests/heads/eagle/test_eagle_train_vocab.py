"""EAGLE-1 over a training vocabulary (``drafter.train_vocab``, heads/training/vocab_teacher.py): the loss covers the N
most frequent training tokens through those rows of the target's lm_head, top-1 and α stay measured against the full
target, the vocabulary travels with the weights, and the drafter stays lossless over it."""

from __future__ import annotations

import pytest
import torch

from treespec import Tree, generate
from treespec.heads import registry
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.eagle import Eagle
from treespec.heads.eagle.objective import eagle_loss, training_unroll
from treespec.heads.registry import load
from treespec.sampling import Sampling

from tests.helpers import (
    RUNS,
    VOCAB,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    random_eagle,
    sampled_counts,
    tiny_llama,
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def test_loss_over_a_training_vocabulary(target):
    """The token term is the KL from the target's distribution restricted to the N ids and renormalised, over the
    entries whose target argmax lies inside; top-1 counts the drafter's argmax mapped back to target ids; α is
    against the full target (mass outside: never accepted); the KL without a vocabulary is unchanged."""
    model = random_eagle(target)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens_only = {"unroll_steps": 0, "feature_weight": 0.0, "token_weight": 1.0}
    full, _ = eagle_loss(target, model, batch, **tokens_only)
    vocab = DraftVocab(torch.arange(0, 64, 2), 64)  # the even ids
    model.set_vocab(vocab)
    loss, metrics = eagle_loss(target, model, batch, **tokens_only)
    with torch.no_grad():
        _, target_logits, steps = training_unroll(target, model, batch, steps=0)
        _, g, _ = next(steps)
        keep = target_logits.argmax(-1) % 2 == 0  # [b, n]: the target's argmax is an even id
        log_p = torch.log_softmax(target_logits[..., vocab.ids], -1)[keep]
        log_q = torch.log_softmax(target.lm_head(g)[..., vocab.ids].float(), -1)[keep]
        expected = -(log_p.exp() * log_q).sum(-1).mean()
        top1 = (vocab.ids[log_q.argmax(-1)] == target_logits.argmax(-1)[keep]).float().mean()
        p_full = torch.softmax(target_logits, -1)[keep]
        q_full = torch.zeros_like(p_full)
        q_full[:, vocab.ids] = log_q.exp()
        alpha = torch.minimum(p_full, q_full).sum(-1).mean()
    assert 0 < keep.sum() < keep.numel()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["top1_0"] == pytest.approx(top1.item()) and metrics["alpha_0"] == pytest.approx(alpha.item())
    with torch.no_grad():  # accuracies and drafting rank the vocabulary's tokens only, by the target head's rows
        proposed = model.proposal_logits(g[0])
        assert torch.isinf(proposed[:, 1::2]).all()
        torch.testing.assert_close(proposed[:, ::2], target.lm_head(g[0])[:, ::2])
    model.set_vocab(None)
    assert eagle_loss(target, model, batch, **tokens_only)[0].item() == full.item()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_recipe_saves_the_vocabulary_and_drafts_losslessly(target, tmp_path):
    """train_vocab=16: the 16 most frequent training tokens, saved beside the weights and the loaded drafter's head;
    greedy output equals vanilla; an upstream export is refused, naming why; a bad size is refused."""
    cfg = compose_cfg("train_heads", ["drafter=eagle", "drafter.accuracy_depth=3", "drafter.train_vocab=16"])
    stream = torch.cat([torch.arange(20).repeat(5), torch.arange(20, 64)])  # ids 0..19 five times, the rest once
    r = registry.get("eagle").recipe(cfg, target, stream)
    assert torch.equal(r.module.vocab.ids, torch.arange(16)) and "training vocabulary 16 of 64" in r.description
    r.export(torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2)), tmp_path)
    assert (tmp_path / "draft_vocab.safetensors").exists()
    drafter = load(tmp_path, target)
    assert torch.equal(drafter.model.vocab.ids, torch.arange(16)) and drafter._logits.vocab is drafter.model.vocab
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    for tree in (Tree.chain(3), None):  # a static chain and the default dynamic tree
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=20)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 20))
    with pytest.raises(Refused, match="trained over 16 of the target's tokens"):
        registry.get("eagle").to_upstream(drafter.model, target, "vllm", verifier="x", speculative_tokens=3)
    from treespec.train.training import drafter_job

    with pytest.raises(ValueError, match="drafter.train_vocab must be null or an integer >= 1"):
        drafter_job.check_config(compose_cfg("train_heads", ["drafter=eagle", "target=/no/such",
                                                             "drafter.train_vocab=0"]))


def test_sampling_over_a_training_vocabulary_is_lossless():
    """At T = 1 the output is distributed as the target's, though the drafter proposes from 8 of its tokens."""
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    model = random_eagle(small)
    model.set_vocab(DraftVocab(torch.arange(0, VOCAB, 2)[:8], VOCAB))
    sampling = Sampling(1.0)
    counts = sampled_counts(small, Eagle(model), Tree.full(2, 2), sampling)
    assert counts.sum() == RUNS
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3

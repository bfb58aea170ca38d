"""Medusa heads: lossless decoding (greedy and sampled), load-time checks, the hydra training entry."""

import json

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate
from treespec.analysis import grow_tree
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.reference import load_model
from treespec.sampling import Sampling
from treespec.train.data import TokenBatches
from treespec.train.medusa import medusa_loss

from .helpers import (
    PROMPT,
    RUNS,
    VOCAB,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    random_heads,
    sampled_counts,
    tiny_llama,
    tiny_trained_target,
    wandb_run_contains,
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2), grow_tree([[0.5, 0.2, 0.1], [0.3, 0.1], [0.2]], 6)])
@pytest.mark.parametrize("share", [True, False])
def test_medusa_greedy_equals_vanilla(target, tree, share):
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    out = generate(target, prompt, drafter=Medusa(random_heads(target, share=share)), tree=tree, max_new_tokens=30)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 30))


def test_untrained_shared_heads_repeat_the_base_prediction(target):
    """Zero-initialised blocks are the identity: every head predicts what the base lm_head predicts."""
    heads = MedusaHeads(32, 64, num_heads=2, lm_head=target.get_output_embeddings())
    hidden = torch.randn(5, 32)
    assert torch.equal(heads(hidden)[1], target.get_output_embeddings()(hidden))
    assert heads.blocks[0][0] is not heads.blocks[1][0]  # distinct modules, not one block repeated


def test_medusa_sampling_is_lossless():
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    sampling = Sampling(1.0)
    counts = sampled_counts(small, Medusa(random_heads(small, num_heads=2, scale=2.0)), Tree.full(2, 2), sampling)
    assert counts.sum() == RUNS
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_mismatched_heads_are_refused(target, tmp_path):
    random_heads(target).save_pretrained(tmp_path)
    other = tiny_llama(hidden=48, seed=1)
    with pytest.raises(ValueError, match=r"Medusa drafter was trained for another target: hidden_size 32 \(drafter\) "
                                         r"vs 48 \(target\).*available\.<name>\.source"):
        MedusaHeads.from_pretrained(tmp_path, other)
    with pytest.raises(ValueError, match=r"vocab_size 64 \(drafter\) vs 80 \(target\)"):
        MedusaHeads.from_pretrained(tmp_path, tiny_llama(vocab=80, seed=1))
    loaded = MedusaHeads.from_pretrained(tmp_path, target)
    with pytest.raises(ValueError, match="deeper than the 3 Medusa heads"):
        generate(target, PROMPT, drafter=Medusa(loaded), tree=Tree.chain(4), max_new_tokens=8)


def test_training_entry_lowers_loss_resumes_and_logs_acceptance(tmp_path, monkeypatch):
    from treespec.train import train_heads as heads_training

    target_dir, cache = tiny_trained_target(tmp_path, monkeypatch)
    common = ["debug=tiny_heads", f"target={target_dir}", cache, "tree=accuracy", "tree.nodes=6"]

    # interrupted after 15 steps, then resumed: the same heads as one uninterrupted run
    heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "trainer.stop_after=15"]))
    resumed = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "resume=true"]))
    whole = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'b'}", "logger=none"]))
    assert whole["steps"] == resumed["steps"] == 60

    a, b = (load_file(tmp_path / r / "final" / "medusa.safetensors") for r in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    assert resumed["eval_tree_nodes"] == 6 and resumed["eval_mean_accept_length"] > 1.0

    # the loss on a fixed batch of the (self-distilled) training data went down
    target, _ = load_model(str(target_dir))
    stream = load_file(next((tmp_path / "cache").glob("distill-*.safetensors")))["tokens"]
    batch = TokenBatches(stream, 32, 8).batch(0)
    untrained = MedusaHeads(32, target.config.vocab_size, num_heads=4, lm_head=target.get_output_embeddings())
    trained = MedusaHeads.from_pretrained(tmp_path / "b" / "final", target)
    with torch.no_grad():
        before = medusa_loss(target, untrained, batch, 0.8)[0]
        after = medusa_loss(target, trained, batch, 0.8)[0]
    assert after < before - 0.5

    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    hist = [r["histogram"]["eval/accept_length"] for r in rows if "histogram" in r]
    assert hist and sum(hist[0]) / len(hist[0]) == pytest.approx(whole["eval_mean_accept_length"])
    assert wandb_run_contains(tmp_path / "a", "eval/accept_length")
    assert (tmp_path / "b" / "final" / "head_accuracy.json").is_file()

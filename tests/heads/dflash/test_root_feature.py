"""DFlash with the root's feature in its block (``root_feature``, heads/dflash/network.py): the weight it adds, each
proposal equal to the block recomputed from the features (one row and a ragged batch), lossless greedy (one prompt,
a ragged batch) and sampled (chi-square, with a negative control), a drafter grown from one without it starting with
its predictions, saved and loaded, and refused by the z-lab export."""

import importlib

import pytest
import torch

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DFlash, DFlashModel, load
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.dflash.network import grow_from
from treespec.heads.dflash.upstream import dflash_to_upstream
from treespec.heads.training.target_states import target_states
from treespec.sampling import Sampling
from treespec.walker import row_by_row

from tests.helpers import (
    accept_everything,
    block_proposal,
    chi2_pvalue,
    exact_distribution,
    expect_batched_greedy,
    hf_greedy,
    proposed_while_accepting,
    random_dflash,
    sampled_counts,
    trained_dflash,
)

TREES = {"chain": Tree.chain(3), "dynamic": DynamicTree(8, 3, 3)}


def with_root_feature(target, seed=0, **options) -> DFlashModel:
    """A random drafter whose root_norm is not zero (zero adds nothing: a test could not see a wrong feature)."""
    model = random_dflash(target, seed=seed, root_feature=True, **options)
    torch.nn.init.normal_(model.root_norm.weight, std=0.5)
    return model


@pytest.fixture(scope="module")
def trained_rooted(target, prompt):
    """Overfit on the target's own greedy continuations, as the shared ``trained``: often right."""
    return trained_dflash(target, prompt, with_root_feature(target))


def test_one_weight_more(target):
    plain, rooted = random_dflash(target), random_dflash(target, root_feature=True)
    assert set(rooted.state_dict()) - set(plain.state_dict()) == {"root_norm.weight"}
    assert rooted.config["root_feature"] and not plain.config["root_feature"]
    assert not rooted.root_norm.weight.any()  # adds nothing at first
    with pytest.raises(ValueError, match="root_feature must be true or false"):
        random_dflash(target, root_feature="yes")
    with pytest.raises(ValueError, match="pass root_features"):
        rooted(rooted.block_ids(torch.tensor([3])), None, torch.arange(4)[None])


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("rows", ["one", "ragged"])
def test_proposals_match_recomputation(target, prompt, tree_name, rows, monkeypatch):
    """The feature generate() hands propose() is the one that produced each row's root: the block equals one
    recomputed from the committed tokens' features."""
    model = with_root_feature(target, seed=2)
    for committed, step_tree, proposal in proposed_while_accepting(target, prompt, DFlash(model), TREES[tree_name],
                                                                   rows, monkeypatch):
        n = committed.shape[1] - 1
        with torch.no_grad():
            features, _ = target_states(target, committed[:, :-1], model.feature_layers)
            out = model(model.block_ids(committed[:, -1]), features, torch.arange(n, n + model.block_size)[None],
                        torch.arange(n)[None], root_features=features[:, -1:])
            log_q = torch.log_softmax(model.logits(out[0, 1:]).float(), -1)
        assert dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True)) == block_proposal(log_q, step_tree)


@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_equals_vanilla(target, prompt, trained_rooted, tree_name):
    out = generate(target, prompt, drafter=DFlash(trained_rooted), tree=TREES[tree_name], max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24)) and out.mean_accept_length > 1.2
    expect_batched_greedy(target, DFlash(trained_rooted), TREES[tree_name])


def test_sampling_is_lossless(small):
    sampling = Sampling(1.0)
    drafter = DFlash(with_root_feature(small, block_size=3), candidates="sample")
    counts = sampled_counts(small, drafter, Tree.full(2, 2), sampling)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(small, DFlash(with_root_feature(small, block_size=3)), Tree.chain(2), sampling)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) < 1e-3


def test_grown_from_a_plain_drafter_saved_loaded_and_not_exported(target, prompt, tmp_path):
    plain = random_dflash(target, seed=4)
    rooted = random_dflash(target, seed=5, root_feature=True)
    grow_from(rooted, plain)  # root_norm zero: the plain drafter's blocks
    windows = hf_greedy(target, prompt, 8)
    anchors = torch.tensor([[2, 6, 9]])
    with torch.no_grad():
        features, _ = target_states(target, windows, plain.feature_layers)
        torch.testing.assert_close(rooted.anchored(windows, features, anchors),
                                   plain.anchored(windows, features, anchors))
    with pytest.raises(ValueError, match="root_feature true \\(init_from\\) against false"):
        grow_from(random_dflash(target), with_root_feature(target))
    trained = with_root_feature(target, seed=6)
    trained.save_pretrained(tmp_path)
    drafter = load(tmp_path, target)
    assert drafter.model.config["root_feature"]
    torch.testing.assert_close(drafter.model.root_norm.weight, trained.root_norm.weight)
    out = generate(target, prompt, drafter=drafter, max_new_tokens=12)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))
    for consumer in ("sglang", "vllm"):
        with pytest.raises(Refused, match="does not add the root's feature"):
            dflash_to_upstream(trained, target, consumer)

"""Hybrid targets (treespec/recurrent.py): tiny random models of the stock gated-delta-net, Mamba-2, Mamba-1 and
short-convolution families, decoded equal to transformers' greedy generate with chains, branching and uneven
trees (static and dynamic) whose paths stop at every depth, and sampled as the target's own law."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import DynamicCache

from treespec import Tree, generate
from treespec.compat import cache_arg
from treespec.recurrent import Snapshot, path_rows, select_rows
from treespec.train.checks import hybrids
from treespec.train.checks.architectures import NotApplicable
from treespec.walker import row_by_row

from tests.helpers.lossless_law import accept_everything

# one family per mixer kind in the default suite, the rest with -m slow (the matrix runs them all); Bamba's own
# cached decode disagrees with its full forward (see docs/hybrids.md)
GREEDY = ["Qwen3.5", "Qwen3-Next", "Nemotron-H", "LFM2", "Jamba",
          *[pytest.param(name, marks=pytest.mark.slow) for name in ("Granite-4 hybrid", "Falcon-H1", "OLMo-hybrid",
                                                                         "Kimi Linear")]]


@pytest.mark.parametrize("tree", list(hybrids.TREES))
@pytest.mark.parametrize("name", GREEDY)
def test_greedy_equals_transformers(name, tree):
    hybrids.check_greedy(name, tree)


@pytest.mark.parametrize("name", ["Qwen3.5", "Nemotron-H", *[pytest.param(name, marks=pytest.mark.slow)
                                                             for name in ("LFM2", "Jamba")]])
def test_eagle_static_and_dynamic_trees(name):
    hybrids.check_eagle(name)
    hybrids.check_eagle(name, dynamic=True)


def test_eagle_refuses_a_family_without_an_attention_layer_of_its_own():
    with pytest.raises(NotApplicable, match="falcon_h1's own class would be a 'hybrid' layer"):
        hybrids.check_eagle("Falcon-H1")


@pytest.mark.parametrize("name", ["Qwen3-Next", "Nemotron-H"])
def test_medusa_and_a_draft_model(name):
    hybrids.check_medusa(name)
    hybrids.check_draft_model(name)


# one hybrid family's sampling by default (its walk and cache rollback are the engine's, whatever the family); the
# others with -m slow
@pytest.mark.parametrize("name", [n if i == 0 else pytest.param(n, marks=pytest.mark.slow)
                                  for i, n in enumerate(hybrids.SAMPLING)])
def test_sampling_is_lossless(name):
    assert hybrids.check_sampling(name, runs=300) > 1e-3


def test_sampling_test_detects_a_biased_walk(monkeypatch):
    """Counts with a walk that accepts whole paths regardless of the target: rejected already at half the runs
    (p ~ 3e-10 at 150), so the test above has the power to see it."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    assert hybrids.check_sampling("Qwen3.5", runs=150) < 1e-3


def test_a_batch_is_refused():
    target = hybrids.build("Qwen3.5")
    with pytest.raises(ValueError, match="cannot be decoded on qwen3_5_text's recurrent layers yet"):
        generate(target, torch.randint(0, 64, (2, 5)), max_new_tokens=2)


def test_path_rows_cover_every_node_at_its_depth():
    tree = hybrids.TREES["uneven tree"]
    rows, lengths = path_rows(tree)
    assert lengths == [2, 3, 4] and rows.shape == (3, 4)
    assert rows[0].tolist() == [0, 2, 2, 2]  # a shorter path repeats its leaf
    for node in range(tree.num_nodes):
        r = next(r for r in range(len(rows)) if node in rows[r, : lengths[r]].tolist())
        assert rows[r].tolist().index(node) == int(tree.depths[node])
    assert path_rows(Tree.chain(0))[0].tolist() == [[0]]


def test_snapshot_restores_every_state_after_a_wider_pass():
    """Rows repeated, a pass fed, then restored: conv, recurrent and attention states equal the snapshot's."""
    target = hybrids.build("Nemotron-H")
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=hybrids.prompt(), **cache_arg(cache), use_cache=True)
        before = hybrids.cache_states(cache)
        assert sum(name != "keys" for name, _ in before) >= 4  # conv and recurrent states of both Mamba layers
        snapshot = Snapshot(cache)
        select_rows(cache, torch.zeros(3, dtype=torch.long))
        target(input_ids=torch.randint(0, 64, (3, 4)), **cache_arg(cache), use_cache=True)
        assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(before, hybrids.cache_states(cache), strict=True))
        snapshot.restore(cache)
    after = hybrids.cache_states(cache)
    assert len(after) == len(before)
    assert all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(before, after, strict=True))


def test_verification_cost_is_measured():
    """Both times are measured (positive, finite); how they compare is the benchmark's to say (docs/hybrids.md), not
    a test's: on a loaded machine the replayed pass once timed below 0.8 of the plain one."""
    tree_pass, with_replay = hybrids.verification_cost("LFM2", repeats=3)
    assert 0 < tree_pass < float("inf") and 0 < with_replay < float("inf")


def test_bamba_disagrees_with_itself_in_transformers():
    """Why Bamba is left out above: its cached one-token decode is far from its own full forward (the others agree
    to float noise), so no decoder can equal transformers' greedy for it."""
    assert hybrids.cached_vs_full("Bamba") > 0.1
    assert hybrids.cached_vs_full("Nemotron-H") < 1e-3


def test_an_older_transformers_is_refused_for_hybrids(monkeypatch):
    import treespec.compat

    monkeypatch.setattr(treespec.compat, "TRANSFORMERS_VERSION", "5.8.1")
    monkeypatch.setattr(treespec.compat, "release", lambda version="5.8.1": (5, 8))
    with pytest.raises(ValueError, match=r"treespec verifies with transformers >= 5.19 only \(this is 5.8.1"):
        generate(hybrids.build("Qwen3.5"), torch.tensor([[1, 2, 3]]), max_new_tokens=2)

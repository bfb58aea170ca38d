"""Hybrid draft models (treespec.recurrent.DraftRows behind treespec.heads.DraftModel): greedy output equal to
transformers' greedy generate of the target, every candidate equal to the draft's own cache-free top-k at its node
(train/checks/hybrid_draft.py), drafts of themselves accepted whole, sampling the target's law, and the refusals."""

from __future__ import annotations

import importlib

import pytest
import torch

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel
from treespec.recurrent import DraftRows, select_rows
from treespec.train.checks import hybrid_draft, hybrids
from treespec.walker import row_by_row

from tests.helpers.lossless_law import accept_everything

# (target, draft): a hybrid draft of a hybrid target (another family, a jittered copy of its own), of a plain
# attention target, and a draft without any attention layer; LFM2's conv window (3) is filled by the 20-token prompt
PAIRS = [("Qwen3.5", "LFM2"), ("LFM2", "LFM2"), ("Qwen3.5", "Qwen3.5"), ("Llama", "LFM2"), ("Llama", "Qwen3.5"),
         ("Nemotron-H", "Mamba-2"),
         *[pytest.param(*pair, marks=pytest.mark.slow) for pair in (("Nemotron-H", "Nemotron-H"), ("Jamba", "Jamba"),
                                                                    ("Qwen3.5", "Mamba"), ("Llama", "Mamba-2"))]]


@pytest.mark.parametrize("tree", ["chain", "tree"])
@pytest.mark.parametrize(("target", "draft"), PAIRS)
def test_greedy_equals_transformers_and_every_candidate_the_drafts_own(target, draft, tree):
    hybrid_draft.check_hybrid_draft(target, draft, tree)


def test_an_uneven_tree():
    hybrid_draft.check_hybrid_draft("LFM2", "LFM2", "uneven tree")


# the rank-0 child is a leaf, its sibling is expanded: the accepted path is never in the last pass's rows, so
# every step restores the root's state (the other trees keep the deepest row)
RESTORING = Tree.from_paths([[0], [1], [1, 0]])


@pytest.mark.parametrize("tree", [RESTORING, Tree.chain(3), DynamicTree(total_tokens=6, depth=3, top_k=2)],
                         ids=["restoring", "chain", "dynamic"])
@pytest.mark.parametrize("name", ["LFM2", "Qwen3.5", "Jamba"])
def test_a_draft_of_itself_is_accepted_whole(name, tree):
    """Jamba: its committed tokens are fed one per pass (its mixer's multi-token scan ignores the cached state)."""
    lengths = hybrid_draft.check_self_draft(name, tree)
    assert max(lengths) > 1


def test_the_candidate_check_catches_a_state_left_unrestored(monkeypatch):
    """A draft that keeps the last pass's first row whatever was accepted: its next candidates are drafted from a
    state past the committed sequence, which the replay against the draft's own forward must catch."""
    def keep_first_row(self, path):
        select_rows(self.cache, torch.tensor([0]))  # attention keys too: their length says nothing of the states
        self.nodes = self.nodes[:1]
        return 0

    monkeypatch.setattr(DraftRows, "keep", keep_first_row)
    with pytest.raises(AssertionError, match="the draft's own forward ranks"):
        hybrid_draft.check_hybrid_draft("Llama", "LFM2", "tree")


def test_sampling_is_lossless():
    assert hybrid_draft.check_draft_sampling(runs=300) > 1e-3


def test_sampling_test_detects_a_biased_walk(monkeypatch):
    """Rejected already at half the runs (p ~ 5e-36 at 150), so the test above has the power to see it."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    assert hybrid_draft.check_draft_sampling(runs=150) < 1e-3


def test_a_batch_is_refused_naming_why():
    target = hybrids.llama()
    with pytest.raises(ValueError, match="recurrent layers, whose tree expansion takes one batch row per tree node"):
        generate(target, torch.randint(0, 64, (2, 5)), drafter=DraftModel(hybrids.build("LFM2")), max_new_tokens=2)


def test_a_hybrid_draft_on_an_older_transformers_is_refused(monkeypatch):
    import treespec.compat

    monkeypatch.setattr(treespec.compat, "TRANSFORMERS_VERSION", "5.8.1")
    monkeypatch.setattr(treespec.compat, "release", lambda version="5.8.1": (5, 8))
    with pytest.raises(ValueError, match=r"this draft model cannot draft trees: .* transformers >= 5.19 only"):
        DraftModel(hybrids.build("Qwen3.5"))


def test_drafting_step_leaves_the_state_as_it_found_it():
    drafter = DraftModel(hybrids.build("LFM2"))
    step = drafter.drafting_step(past_len=32, n_tokens=4)
    before = hybrids.cache_states(drafter.cache)
    step()
    step()
    after = hybrids.cache_states(drafter.cache)
    assert sum(name == "conv_states" for name, _ in before) == 2  # LFM2's two convolution layers
    assert len(after) == len(before) and all(n == m and torch.equal(a, b)
                                             for (n, a), (m, b) in zip(before, after, strict=True))

"""Blocks anchored where prompt lookup misses (heads/training/anchors.py, ``lookup_misses``; DFlash's
``anchors_at="lookup_miss"``): the positions are exactly those where PromptLookup proposes nothing, packed
conversations do not match across each other, and the loss anchors only there."""

import pytest
import torch

from treespec import Tree
from treespec.heads import PromptLookup
from treespec.heads.dflash.objective import check_settings, dflash_loss
from treespec.heads.training.anchors import lookup_misses

from tests.helpers import dflash_target, random_dflash


def naive_misses(row: list[int], n: int, segments: list[int] | None = None) -> list[bool]:
    """Position a misses when no j < a ends an n-gram equal to the one ending at a, both inside a's conversation."""
    seg = segments or [0] * len(row)

    def whole(e):  # an n-gram ends at e, inside one conversation
        return e >= n - 1 and all(seg[i] == seg[e] for i in range(e - n + 1, e + 1))

    return [not whole(a) or not any(whole(j) and seg[j] == seg[a] and row[j - n + 1 : j + 1] == row[a - n + 1 : a + 1]
                                    for j in range(a)) for a in range(len(row))]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_misses_equal_a_direct_search(n):
    ids = torch.randint(0, 4, (3, 40), generator=torch.Generator().manual_seed(n))
    got = lookup_misses(ids, n)
    for b in range(3):
        assert got[b].tolist() == naive_misses(ids[b].tolist(), n)
    assert 0 < got.float().mean() < 1  # both kinds present: the comparison means something


def test_packed_conversations_do_not_match_each_other():
    ids = torch.tensor([[5, 6, 7, 5, 6, 5, 6, 8, 5, 6]])
    segments = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    got = lookup_misses(ids, 2, segments)
    assert got[0].tolist() == naive_misses(ids[0].tolist(), 2, segments[0].tolist())
    # (5, 6) at 6 starts conversation 1 anew: it misses, though conversation 0 holds it; at 9 it matches 6
    assert got[0, 6] and not got[0, 9] and not got[0, 4]
    assert got[0, 5]  # (6, 5) across the boundary is no n-gram of either conversation


@pytest.mark.parametrize("low", [1, 2])
def test_misses_are_where_prompt_lookup_proposes_nothing(low):
    ids = torch.randint(0, 6, (1, 60), generator=torch.Generator().manual_seed(7))
    miss = lookup_misses(ids, low)[0]
    lookup = PromptLookup(min_ngram=low, max_ngram=4)
    for a in range(1, 60):  # the root is the last committed token: a
        proposal = lookup.propose_row(ids[0, : a + 1], Tree.chain(3))
        assert (len(proposal.tree) == 0) == bool(miss[a]), a


def test_the_loss_anchors_only_where_lookup_misses():
    target_ids = torch.tensor([[3, 9, 4, 9, 4, 9, 4, 9, 4, 11, 12, 13, 9, 4, 14, 15]])  # (9, 4) repeats
    miss = lookup_misses(target_ids, 2)[0]
    eligible = int(miss[1:-1].sum())  # anchors lie in 1 .. S − 2
    target = dflash_target()
    model = random_dflash(target)
    _, everywhere = dflash_loss(target, model, target_ids, anchors=32)
    _, missing = dflash_loss(target, model, target_ids, anchors=32, anchors_at="lookup_miss")
    assert everywhere["anchors"] == 14 and missing["anchors"] == eligible < 14
    # with every position a miss the filter changes nothing: the same anchors, the same loss
    distinct = torch.arange(20, 36)[None]
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    plain, _ = dflash_loss(target, model, distinct, anchors=5, generator=gen())
    filtered, _ = dflash_loss(target, model, distinct, anchors=5, anchors_at="lookup_miss", generator=gen())
    torch.testing.assert_close(plain, filtered)
    with pytest.raises(ValueError, match="anchors_at"):
        dflash_loss(target, model, distinct, anchors=5, anchors_at="somewhere")


@pytest.mark.parametrize("key, value", [("anchors_at", "misses"), ("lookup_min_ngram", 0),
                                        ("lookup_min_ngram", True)])
def test_settings_name_a_bad_anchor_choice(key, value):
    settings = {"train_vocab": None, "block_size": 8, "num_layers": 1, "anchors": 4, "accuracy_depth": 3,
                "position_decay": 0.9, "loss": "kl", "anchors_at": "all", "lookup_min_ngram": 2}
    check_settings(settings)
    with pytest.raises(ValueError, match=key):
        check_settings({**settings, key: value})

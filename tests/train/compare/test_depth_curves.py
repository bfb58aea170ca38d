"""Per-depth acceptance curves (train/compare/depth_curves.py) from a comparison's accept lengths."""

import pytest

from treespec.train.compare import depth_curves


def test_survival_counts_passes_accepting_at_least_d_drafted_tokens():
    # accept lengths commit accepted + 1: [1, 2, 3, 3] accepted 0, 1, 2, 2 drafted tokens
    assert depth_curves.survival([1, 2, 3, 3], 3) == [0.75, 0.5, 0.0]


def test_curves_pair_drafters_on_shared_trees_and_table_lists_them(tmp_path):
    def rec(drafter, tree, depth, lengths, acceptance="rejection"):
        return {"drafter": drafter, "tree": tree, "depth": depth, "acceptance": acceptance,
                "runs": {"accept_lengths": [lengths[:2], lengths[2:]]}}

    result = {"records": [rec("vanilla", "vanilla", 0, [1, 1]), rec("a", "chain γ=2", 2, [1, 3, 2, 3]),
                          rec("b", "chain γ=2", 2, [1, 1, 2, 1]), rec("a", "chain γ=4", 4, [5, 5]),
                          rec("b", "chain γ=2", 2, [3, 3, 3], acceptance="block")]}
    by_tree = depth_curves.curves([result])
    assert list(by_tree) == ["chain γ=2"]  # γ=4 and the block row have one configuration each
    assert by_tree["chain γ=2"]["a"]["survival"] == [0.75, 0.5] and by_tree["chain γ=2"]["b"]["tau"] == 1.25
    assert "| a | 4 | 2.25 | 0.750 | 0.500 |" in depth_curves.table(by_tree)
    assert list(depth_curves.curves([result], trees=["chain γ=4"])) == ["chain γ=4"]
    assert depth_curves.plot(by_tree, tmp_path / "c.png", "t").is_file()
    with pytest.raises(KeyError):
        depth_curves.curves([{"no records": []}])

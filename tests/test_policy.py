"""Tree specifications from configs: every kind builds, bad specifications name themselves."""

import pytest

from treespec import Tree
from treespec.policy import build_tree


def test_kinds_build():
    assert build_tree({"kind": "chain", "depth": 3}) == Tree.chain(3)
    assert build_tree({"kind": "full", "width": 2, "depth": 2}) == Tree.full(2, 2)
    assert build_tree({"kind": "paths", "paths": [[0], [1], [0, 0]]}) == Tree.from_paths([(0,), (1,), (0, 0)])
    acc = [[0.6, 0.2], [0.4, 0.1]]
    tree = build_tree({"kind": "accuracy", "nodes": 3}, accuracy=acc)
    assert len(tree) == 3 and set(tree.paths) == {(0,), (1,), (0, 0)}
    assert build_tree(Tree.chain(2)) == Tree.chain(2)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "chain"}, r"lacks 'depth'"),
    ({"kind": "ladder", "depth": 2}, r"kind 'ladder' is not one of"),
    ({"kind": "full", "width": 0, "depth": 2}, r"bad tree spec .*'width': 0"),
    ({"kind": "paths", "paths": [[0, 1]]}, r"\(0, 1\) has no parent"),
    ({"kind": "accuracy", "nodes": 4}, r"needs measured per-depth top-k accuracies"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        build_tree(spec)

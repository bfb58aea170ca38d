"""treespec.tree.Tree: constructors, topology invariants (hypothesis over random trees), bad input, files."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treespec.tree import Tree

MEDUSA_LIKE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@st.composite
def random_paths(draw, max_nodes: int = 24):
    """A valid list of paths, shuffled: each new node hangs under a random earlier node (or the root)."""
    n = draw(st.integers(1, max_nodes))
    paths: list[tuple[int, ...]] = []
    next_rank = {(): 0}  # next unused rank under each existing path
    for _ in range(n):
        parent = draw(st.sampled_from([(), *paths]))
        rank = next_rank[parent] + draw(st.integers(0, 2))  # ranks may skip (a tree need not use every rank)
        next_rank[parent] = rank + 1
        child = (*parent, rank)
        next_rank[child] = 0
        paths.append(child)
    return draw(st.permutations(paths))


def test_from_paths_numbering():
    tree = Tree.from_paths(MEDUSA_LIKE)
    assert len(tree) == 6 and tree.num_nodes == 7
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))  # breadth-first, then by path
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.children == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.leaf_paths == [[1, 4], [2, 5], [1, 3, 6]]
    assert tree.path_to(6).tolist() == [1, 3, 6]
    assert tree.depth == 3 and tree.max_width == 3
    assert tree.top_k_per_depth() == [2, 2, 1]


@pytest.mark.parametrize("width, depth", [(1, 0), (1, 3), (2, 1), (2, 3), (3, 2)])
def test_full_sizes(width, depth):
    tree = Tree.full(width, depth)
    assert len(tree) == sum(width**d for d in range(1, depth + 1))
    assert tree.depth == depth
    assert tree.is_leaf.sum().item() == (width**depth if depth else 1)


@pytest.mark.parametrize("depth", [0, 1, 5])
def test_chain(depth):
    tree = Tree.chain(depth)
    assert len(tree) == depth
    assert tree.parents.tolist() == [-1] + list(range(depth))
    assert tree.depths.tolist() == list(range(depth + 1))
    assert tree.ancestors.equal(torch.ones(depth + 1, depth + 1, dtype=torch.bool).tril())


@settings(max_examples=60, deadline=None)
@given(random_paths())
def test_invariants(paths):
    tree = Tree.from_paths(paths)
    n, big_n = len(paths), len(paths) + 1
    assert len(tree) == n and tree.num_nodes == big_n
    assert tree == Tree.from_paths(sorted(paths)) and hash(tree) == hash(Tree.from_paths(sorted(paths)))
    nodes = torch.arange(1, big_n)
    parents = tree.parents[1:]
    assert tree.parents[0] == -1 and (parents < nodes).all()  # parents precede children
    assert (tree.depths[1:] == tree.depths[parents] + 1).all()
    assert (tree.depths[1:].diff() >= 0).all()  # breadth-first order
    for i in range(1, big_n):
        path = tree.paths[i - 1]
        assert tree.ranks[i] == path[-1] and len(path) == tree.depths[i]
        parent = int(tree.parents[i])
        assert path[:-1] == (tree.paths[parent - 1] if parent else ())
    # ancestors: row i = row parent(i) plus i itself
    expected = torch.eye(big_n, dtype=torch.bool)
    expected[1:] |= tree.ancestors[parents]
    assert tree.ancestors.equal(expected)
    assert tree.ancestors[:, 0].all() and (tree.ancestors.sum(dim=1) == tree.depths + 1).all()
    # leaf paths: one per leaf, parent chains from depth 1, together covering every node
    leaves = [p[-1] for p in tree.leaf_paths]
    assert sorted(leaves) == torch.nonzero(tree.is_leaf[1:]).flatten().add(1).tolist()
    for p in tree.leaf_paths:
        assert tree.parents[p[0]] == 0 and all(tree.parents[b] == a for a, b in zip(p, p[1:], strict=False))
        assert tree.path_to(p[-1]).tolist() == p
    assert set().union(*map(set, tree.leaf_paths)) == set(range(1, big_n))
    assert sum(len(k) for k in tree.children) == n


@settings(max_examples=30, deadline=None)
@given(random_paths(), st.integers(0, 6))
def test_truncate(paths, max_depth):
    tree = Tree.from_paths(paths)
    cut = tree.truncate(max_depth)
    assert set(cut.paths) == {p for p in paths if len(p) <= max_depth}
    assert cut.depth == min(max_depth, tree.depth)
    assert tree.truncate(tree.depth) is tree


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (1, 0)], r"\(1, 0\).*prefix \(1,\)"),  # missing prefix
        ([(0,), (0, 0), (0,)], r"\(0,\) appears twice"),  # duplicate
        ([(0,), (0, -1)], r"\(0, -1\) has a negative rank"),
        ([(0,), ()], r"\(\) is empty"),
        ([], "at least one path"),
    ],
)
def test_bad_paths_raise(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(paths)


@pytest.mark.parametrize("make", [lambda: Tree.chain(-1), lambda: Tree.full(0, 2), lambda: Tree.full(2, -1)])
def test_bad_shapes_raise(make):
    with pytest.raises(ValueError):
        make()


def test_levels_group_nodes_by_depth():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    assert tree.levels == [[0], [1, 2], [3, 4], [5]]


def test_save_and_load_round_trip(tmp_path):
    from treespec.dynamic_tree import DynamicTree

    tree = Tree.from_paths(MEDUSA_LIKE)
    path = tree.save(tmp_path / "t" / "best_tree.json", drafter="eagle", speedup=1.5)
    assert Tree.load(path) == tree
    assert json.loads(path.read_text())["about"] == {"drafter": "eagle", "speedup": 1.5}
    assert Tree.load(Tree.chain(0).save(tmp_path / "empty.json")) == Tree.chain(0)  # auto's "no speculation"
    from treespec.planning.tree_spec import load_tree, save_tree

    # a dynamic tree's settings come back as the spec dict generate() takes (tree_spec.load_tree builds it)
    path = save_tree(DynamicTree(16, 5, 4), tmp_path / "dynamic.json", drafter="eagle")
    assert Tree.load(path) == {"kind": "dynamic", "total_tokens": 16, "depth": 5, "top_k": 4}
    loaded = load_tree(path)
    assert isinstance(loaded, DynamicTree) and (loaded.total_tokens, loaded.depth, loaded.top_k) == (16, 5, 4)


@pytest.mark.parametrize("content, message", [
    ('{"kind": "accuracy", "nodes": 4}', r"still needs a drafter's accuracies"),
    ('{"kind": "paths", "paths": [[0, 1]]}', r"tree file .*has no parent"),
    ("[1, 2]", r"not a tree spec"),
    ('{"kind": "paths"', r"not valid JSON"),
    ('{"kind": "dynamic", "total_tokens": 4}', r"tree file .*lacks depth, top_k"),
])
def test_bad_tree_files_are_named(tmp_path, content, message):
    from treespec.planning.tree_spec import load_tree

    path = tmp_path / "tree.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tree(path)

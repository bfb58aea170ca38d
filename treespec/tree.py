"""Static tree topology: Medusa-style paths of top-k ranks ⇄ parents, depths, ranks, ancestors.

Node numbering (used everywhere in treespec): node 0 is the root, the last committed token, which is
verified together with the candidates; nodes 1..n are the candidates in breadth-first order (by depth,
then by path). A path ``(r0, r1, ...)`` names the node reached by taking the r0-th ranked candidate at
depth 1, then the r1-th ranked child of that, and so on (Medusa's "choices", Cai et al. 2024).
``len(tree)`` is n, the number of candidates; a verification pass feeds n + 1 tokens.

``tree.save(path)`` writes its paths as JSON and ``Tree.load(path)`` reads them back (a dynamic tree's
settings, saved with treespec.planning.tree_spec.save_tree, come back as the spec dict generate() also takes): the
comparison saves every configuration's tree that way, so the best one can be handed to
``generate(..., tree=Tree.load(".../best_tree.json"))``.
"""

from __future__ import annotations

import numbers
from collections import Counter
from functools import cached_property
from itertools import product
from pathlib import Path

import torch

from treespec.io import atomic_write_json, read_json


def whole(value, what: str) -> int:
    """``value`` as an int when it is an integer (int, numpy integer); anything else (4.7, "4", True) is a
    ValueError naming ``what``: a tree size is never rounded silently."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


class Tree:
    """An immutable token-tree topology. All tensors index nodes 0..n (0 = root)."""

    def __init__(self, paths):
        paths = [p if type(p) is tuple and all(type(r) is int for r in p) else  # ints already: the per-step fast path
                 tuple(whole(r, f"tree path {tuple(p)!r}: a rank") for r in p) for p in paths]
        seen = set()
        for p in paths:
            if len(p) == 0:
                raise ValueError("tree path () is empty: the root is implicit, list only candidate paths")
            if any(r < 0 for r in p):
                raise ValueError(f"tree path {p} has a negative rank")
            if p in seen:
                raise ValueError(f"tree path {p} appears twice")
            seen.add(p)
        for p in paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"tree path {p} has no parent: its prefix {p[:-1]} is not in the tree")
        self.paths: tuple[tuple[int, ...], ...] = tuple(sorted(paths, key=lambda p: (len(p), p)))
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        # as Python ints for the host's per-step loops (a dynamic tree is new every step), and as tensors
        self.parent_list = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in self.paths]
        self.depth_list = [0] + [len(p) for p in self.paths]
        self.rank_list = [0] + [p[-1] for p in self.paths]
        self.parents = torch.tensor(self.parent_list, dtype=torch.long)  # [N], N = n + 1
        self.depths = torch.tensor(self.depth_list, dtype=torch.long)  # [N]
        self.ranks = torch.tensor(self.rank_list, dtype=torch.long)  # [N]

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_paths(cls, paths) -> Tree:
        """A tree from Medusa-style choices; every prefix of a path must be a path too."""
        paths = list(paths)
        if not paths:
            raise ValueError("a tree needs at least one path; use Tree.chain(0) for no candidates")
        return cls(paths)

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """γ = depth top-1 candidates in a line: classic (chain) speculative decoding."""
        depth = whole(depth, "chain depth")
        if depth < 0:
            raise ValueError(f"chain depth must be >= 0, got {depth}")
        return cls([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def full(cls, width: int, depth: int) -> Tree:
        """Every node has ``width`` children down to ``depth``: width + width² + ... nodes."""
        width, depth = whole(width, "full tree width"), whole(depth, "full tree depth")
        if width < 1 or depth < 0:
            raise ValueError(f"full tree needs width >= 1 and depth >= 0, got width={width}, depth={depth}")
        return cls([p for d in range(1, depth + 1) for p in product(range(width), repeat=d)])

    # -- files ---------------------------------------------------------------------------------
    def to_spec(self) -> dict:
        """The tree-spec dict that builds this tree again: its paths (a chain of depth 0 when empty)."""
        if not len(self):  # no candidates (auto chose not to speculate): vanilla decoding
            return {"kind": "chain", "depth": 0}
        return {"kind": "paths", "paths": [list(p) for p in self.paths]}

    def save(self, path, /, **about) -> Path:
        """Write ``{"kind": "paths", "paths": [...], "about": about}`` to ``path`` (JSON); ``about`` says where
        the tree came from (drafter, run, measured speedup). Returns the path."""
        return write_spec(self.to_spec(), path, **about)

    @staticmethod
    def load(path) -> Tree | dict:
        """The tree a ``save`` file holds. A file of another kind (a dynamic tree's settings, written by
        treespec.planning.tree_spec.save_tree) gives its tree-spec dict, which generate() takes as ``tree=`` too."""
        data = read_json(path, "tree file")
        if not isinstance(data, dict) or "kind" not in data:
            raise ValueError(f"tree file {path} holds {type(data).__name__}, not a tree spec with a kind")
        if not isinstance(data["kind"], str):
            raise ValueError(f"tree file {path}: its kind must be a string such as \"paths\", got {data['kind']!r}")
        spec = {k: v for k, v in data.items() if k != "about"}
        try:
            if spec["kind"] == "paths" and set(spec) == {"kind", "paths"}:
                return Tree.from_paths([tuple(p) for p in spec["paths"]])
            if spec["kind"] == "chain" and set(spec) == {"kind", "depth"} and isinstance(spec["depth"], int):
                return Tree.chain(spec["depth"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"tree file {path}: {err}") from None
        return spec

    # -- topology -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Tree(nodes={len(self)}, depth={self.depth}, width={self.max_width})"

    @property
    def num_nodes(self) -> int:
        """Nodes fed to the target per verification pass: candidates + root."""
        return len(self.paths) + 1

    @cached_property
    def depth(self) -> int:
        return max(self.depth_list)

    @cached_property
    def max_width(self) -> int:
        return max(Counter(self.depth_list[1:]).values()) if len(self) else 1

    @cached_property
    def is_chain(self) -> bool:
        """One node per depth (the root alone included): causal attention is already its tree mask."""
        return self.max_width == 1

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """BoolTensor [N, N]: ancestors[i, j] is True iff j is i itself or an ancestor of i."""
        n = self.num_nodes
        anc = torch.eye(n, dtype=torch.bool)
        node = torch.arange(n)
        up = self.parents.clamp(min=0)  # the root is its own parent: walking up from it stays at 0
        for _ in range(self.depth):  # one tensor op per level, not one per node (dynamic trees build one per step)
            node = up[node]
            anc[torch.arange(n), node] = True
        return anc

    @cached_property
    def children(self) -> list[list[int]]:
        """children[i]: child node indices of node i, in rank order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parent_list[i]].append(i)
        return [sorted(k, key=self.rank_list.__getitem__) for k in kids]

    @cached_property
    def levels(self) -> list[list[int]]:
        """levels[d]: node indices at depth d (levels[0] == [0]), as Python ints for per-step loops."""
        out: list[list[int]] = [[] for _ in range(self.depth + 1)]
        for i, d in enumerate(self.depth_list):
            out[d].append(i)
        return out

    @cached_property
    def is_leaf(self) -> torch.Tensor:
        """BoolTensor [N]."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
        has_child[self.parents[1:]] = True
        return ~has_child

    @cached_property
    def leaf_paths(self) -> list[list[int]]:
        """Root-to-leaf node-index paths (root excluded), one per leaf."""
        return [
            torch.nonzero(self.ancestors[i]).flatten()[1:].tolist()
            for i in range(1, self.num_nodes)
            if self.is_leaf[i]
        ]

    def path_to(self, node: int) -> torch.Tensor:
        """LongTensor [depth(node)]: node indices from depth 1 down to ``node`` (root excluded)."""
        return torch.tensor(self.path_list(node), dtype=torch.long)

    def path_list(self, node: int) -> list[int]:
        """``path_to(node)`` as Python ints."""
        path = []
        while node > 0:  # up the parents on the host
            path.append(node)
            node = self.parent_list[node]
        return path[::-1]

    def truncate(self, max_depth: int) -> Tree:
        """The subtree of nodes at depth <= max_depth (used when few tokens remain to generate)."""
        if max_depth >= self.depth:
            return self
        return Tree([p for p in self.paths if len(p) <= max_depth])

    def top_k_per_depth(self) -> list[int]:
        """Largest rank + 1 used at each depth 1..depth (how many top-k candidates a drafter needs)."""
        ks = [0] * self.depth
        for p in self.paths:
            ks[len(p) - 1] = max(ks[len(p) - 1], p[-1] + 1)
        return ks


def write_spec(spec: dict, path, /, **about) -> Path:
    """A tree-spec dict as JSON at ``path`` (folders made), ``about`` under "about"."""
    return atomic_write_json(path, {**spec, **({"about": about} if about else {})}, default=str)

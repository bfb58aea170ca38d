"""Tree specs: the one parser from a config dict to the tree a step verifies.

Static kinds (one Tree for every step):
    {"kind": "chain", "depth": γ}                   classic speculative decoding
    {"kind": "full", "width": w, "depth": d}
    {"kind": "paths", "paths": [[0], [1], [0, 0]]}   Medusa "choices"
    {"kind": "accuracy", "nodes": n}                 grown greedily from the drafter's measured per-depth
                                                     top-k accuracies (Medusa's sparse trees; analysis.grow_tree)
    {"kind": "auto", "max_nodes": n}                 the accuracy-grown tree with the best predicted tokens/s
                                                     on this device's cost curve (treespec.planning.autotree)
    {"kind": "auto", "batch_sizes": [1, 2, 4, 8]}    one per batch size, from costs measured at each, followed
                                                     as rows finish: a TreesByBatch (planning/batch_table.py;
                                                     generate() resolves it, since it measures on the target)
    {"kind": "default"}                              the drafter's own ``default_tree`` (Token Recycling's
                                                     template, SuffixDecoding's budget, ...)
Dynamic kind (grown by the drafter every step; EAGLE-2):
    {"kind": "dynamic", "total_tokens": n, "depth": d, "top_k": k}   → DynamicTree

``check_tree_spec`` validates a spec without building it (jobs call it at start-up, before any model is
loaded or trained); ``build_tree`` builds it from what the kind needs. Unknown kinds, unknown keys, missing
keys and bad values raise ValueError naming the spec.

The accuracy kinds need the drafter's measurements: its ``DrafterProfile`` (treespec/planning/profile.py; generate()
passes the one it is given): its ``accuracy`` (a trained drafter's folder holds them, head_accuracy.json, and
treespec.heads.load_profile reads them) and, for "auto", its ``tree_chooser`` (made from the device's cost
curve saved beside it, cost_curve.json: treespec.planning.autotree.save_cost_curve / saved_chooser).

``save_tree``/``load_tree`` (``Tree.save``/``Tree.load``) keep a resolved tree as JSON: its paths, or a
dynamic tree's settings, so a tree chosen by a comparison run can be used elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from treespec.batch_trees import check_batch_sizes
from treespec.dynamic_tree import DynamicTree
from treespec.planning.analysis import grow_tree
from treespec.planning.autotree import chains_only, is_tau_source
from treespec.tree import Tree, write_spec

# kind → (required keys, optional keys with their defaults)
KINDS: dict[str, tuple[tuple[str, ...], dict]] = {
    "chain": (("depth",), {}),
    "full": (("width", "depth"), {}),
    "paths": (("paths",), {}),
    "accuracy": (("nodes",), {}),
    "auto": ((), {"max_nodes": 64}),
    "dynamic": (("total_tokens", "depth", "top_k"), {}),
    "default": ((), {}),
}
#: keys a kind takes that stay absent unless given (no default filled in: a spec without one is unchanged)
UNFILLED = {"auto": ("batch_sizes",)}
NEEDS_ACCURACY = ("accuracy", "auto")  # kinds grown from a drafter's measured per-depth top-k accuracies
CHAIN_RULES = ("block",)  # acceptance rules that verify chains only (treespec/walker_traversal.py)


def check_tree_spec(spec) -> dict | Tree | DynamicTree:
    """The spec as a plain dict with defaults filled in; ValueError for an unknown kind or key, a missing key
    or a value that cannot build a tree. A Tree or DynamicTree passes as is."""
    if isinstance(spec, (Tree, DynamicTree)):
        return spec
    spec = _normalized(spec)
    if spec["kind"] not in (*NEEDS_ACCURACY, "default"):  # build it once to check it; the others need a drafter
        build_tree(spec)
    else:
        if spec.get("batch_sizes") is not None:
            spec["batch_sizes"] = check_batch_sizes(spec["batch_sizes"])
        for key in ("nodes", "max_nodes"):
            if key in spec and not (isinstance(spec[key], int) and not isinstance(spec[key], bool) and spec[key] >= 1):
                raise ValueError(f"tree spec {spec}: {key} must be an integer >= 1")
    return spec


def build_tree(spec, accuracy=None, choose=None, profile=None, candidates: str = "topk",
               acceptance: str = "rejection", sampling=None, default=None, drafter=None,
               prompt=None) -> Tree | DynamicTree:
    """A Tree (a DynamicTree for kind "dynamic") from a spec dict (or either, returned as is).

    ``accuracy[d][r]``: probability that the rank-r candidate at depth d+1 is the accepted one (kinds
    "accuracy" and "auto"), or for "auto" a τ source (treespec.planning.autotree.tau_source); ``choose(accuracy,
    max_nodes) -> Tree`` picks the "auto" tree (it needs the device's cost curve, see
    treespec.planning.autotree.auto_chooser). Without them, a ``profile``'s are used (``DrafterProfile.tau_source``: its
    measured chain τ under ``acceptance`` at ``sampling`` when the drafter samples its ``candidates``, else its
    ``accuracy``; and its ``tree_chooser``); a chain τ the profile lacks at that sampling is measured on ``drafter``
    and ``prompt`` [1, P] where the profile can (``DrafterProfile.measure_chain_tau``). ``default``: the drafter's
    ``default_tree``, for kind "default"."""
    if isinstance(spec, (Tree, DynamicTree)):
        return spec
    spec = _normalized(spec)
    kind = spec["kind"]
    if profile is not None and kind in NEEDS_ACCURACY:
        accuracy = accuracy if accuracy is not None else \
            profile.tau_source(kind, candidates, acceptance, sampling, drafter, prompt)
        choose = choose if choose is not None else profile.tree_chooser
    try:
        if kind == "chain":
            return Tree.chain(_int(spec["depth"]))
        if kind == "full":
            return Tree.full(_int(spec["width"]), _int(spec["depth"]))
        if kind == "paths":
            return Tree.from_paths([tuple(p) for p in spec["paths"]])
        if kind == "dynamic":
            return DynamicTree(_int(spec["total_tokens"]), _int(spec["depth"]), _int(spec["top_k"]))
        if kind == "default":
            if default is None:
                raise ValueError("needs the drafter whose default_tree it names (generate(tree=...) with a drafter)")
            return default
        if accuracy is None:
            raise ValueError("needs the drafter's measured per-depth top-k accuracies: a trained drafter's folder "
                             "holds them (head_accuracy.json): pass profile=treespec.heads.load_profile(folder), or "
                             "a treespec.planning.profile.DrafterProfile(accuracy=...)")
        if kind == "accuracy":
            if is_tau_source(accuracy):  # τ measured per tree or per chain: no ranks to grow a tree from
                raise ValueError(f"grows a tree from rank accuracies, and this drafter is predicted from {accuracy!r}: "
                                 "ask for {'kind': 'auto'}, which chooses among what was measured")
            return grow_tree(accuracy, _int(spec["nodes"]))
        if spec.get("batch_sizes") is not None:
            raise ValueError("a tree per batch size is chosen from costs measured on the target at each size: "
                             "treespec.generate(..., tree=spec, profile=...) measures and resolves it (plan_tree)")
        if choose is None:
            raise ValueError("needs this device's cost curve to choose from: load the profile with its target, "
                             "treespec.heads.load_profile(source, target), which measures one on first use, or give "
                             "the profile tree_chooser=treespec.planning.autotree.auto_chooser("
                             "measure_cost_curve(target))")
        if acceptance in CHAIN_RULES:  # never a tree its rule refuses
            accuracy = chains_only(accuracy)
        return choose(accuracy, _int(spec["max_nodes"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad tree spec {spec}: {err}") from None


def _normalized(spec) -> dict:
    """Kind and keys checked, optional keys filled in."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"a tree spec is a dict such as {{'kind': 'chain', 'depth': 3}} (or a Tree), got {spec!r}")
    spec = dict(spec)
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"tree spec {spec}: kind {kind!r} is not one of {tuple(KINDS)}")
    if kind == "auto" and "drafters" in spec:  # a comparison's tree entry, never one drafter's tree
        raise ValueError(f"tree spec {spec}: choosing across drafters is planning, before generate(), which decodes "
                         "with one drafter: treespec.planning.across.plan_across(target, input_ids, {name: (drafter, "
                         "profile), ...}); in a comparison's trees, {kind: auto, drafters: [...]} names its drafters")
    required, optional = KINDS[kind]
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValueError(f"tree spec {spec} lacks {', '.join(missing)} (kind {kind!r} needs {', '.join(required)})")
    unfilled = UNFILLED.get(kind, ())
    unknown = sorted(set(spec) - {"kind", *required, *optional, *unfilled})
    if unknown:
        raise ValueError(f"tree spec {spec}: unknown key(s) {', '.join(unknown)} for kind {kind!r} "
                         f"(it takes {', '.join((*required, *optional, *unfilled))})")
    return {**optional, **spec}


def _int(value) -> int:
    """Integers only (hydra and JSON give ints): 2.5 or "3" is a mistake, not something to round."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


# -- files -------------------------------------------------------------------------------------------------
def tree_to_spec(tree: Tree | DynamicTree) -> dict:
    """The spec that builds ``tree`` again: its paths (Tree.to_spec), or its dynamic settings."""
    if isinstance(tree, DynamicTree):
        return {"kind": "dynamic", "total_tokens": tree.total_tokens, "depth": tree.depth, "top_k": tree.top_k}
    if not isinstance(tree, Tree):
        raise ValueError(f"only a Tree or a DynamicTree can be saved, got {type(tree).__name__}")
    return tree.to_spec()


def save_tree(tree: Tree | DynamicTree, path, /, **about) -> Path:
    """``tree`` as JSON at ``path`` (``tree_to_spec``, the format Tree.save writes), ``about`` under "about"."""
    return write_spec(tree_to_spec(tree), path, **about)


def load_tree(path) -> Tree | DynamicTree:
    """The Tree or DynamicTree a ``save_tree`` file holds; a file holding anything else is named."""
    spec = Tree.load(path)
    if isinstance(spec, Tree):
        return spec
    if spec.get("kind") in NEEDS_ACCURACY:
        raise ValueError(f"tree file {path} holds {spec}, which still needs a drafter's accuracies: save the tree it "
                         "resolved to (its paths)")
    try:
        return build_tree(spec)
    except ValueError as err:
        raise ValueError(f"tree file {path}: {err}") from None

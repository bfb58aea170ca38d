"""The public ``generate()``: plan, then decode. A tree spec is resolved into the tree the loop verifies before any
of the call's decoding starts (``plan_tree``), then the loop runs with it (``treespec.generate.decode``).

Resolving "accuracy" and "auto" reads the drafter's ``profile`` and may measure what it lacks (a chain τ at a new
sampling, by decoding the target's own continuations of the prompt: treespec/planning/chain_tau.py). That
measurement calls the loop directly, here, before the call's own decoding: so one decoding never runs inside
another, and the loop (treespec/generate.py) holds no path back into planning. ``plan_tree`` is public too: a caller
that decodes many prompts with one spec plans once and passes the tree, as the comparison does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from treespec.dynamic_tree import DynamicTree
from treespec.generate import decode
from treespec.inputs import check_arguments
from treespec.planning.autotree import chains_only
from treespec.planning.batch_table import plan_batch_table
from treespec.planning.profile import DrafterProfile
from treespec.planning.tree_spec import CHAIN_RULES, build_tree, check_tree_spec
from treespec.result import GenerationResult
from treespec.tree import Tree

LOOP = inspect.signature(decode)  # the loop's arguments and their defaults, named once (there)


def loop_arguments(target, input_ids, **options) -> dict:
    """Every argument of ``decode`` by name, defaults filled in: a missing or unknown one is a TypeError naming it,
    before anything is planned or measured."""
    call = LOOP.bind(target, input_ids, **options)
    call.apply_defaults()
    return dict(call.arguments)


def plan_tree(target, input_ids, *, tree=None, profile: DrafterProfile | None = None,
              **options) -> Tree | DynamicTree | None:
    """The tree ``generate(target, input_ids, tree=tree, profile=profile, **options)`` decodes with: a tree-spec dict
    built (treespec/planning/tree_spec.py), measuring first what its kind needs and the profile can measure;
    anything else as given (the loop checks it). Every other argument is checked before anything is measured."""
    if profile is not None and not isinstance(profile, DrafterProfile):
        raise ValueError(f"profile must be a treespec.planning.profile.DrafterProfile or None, got "
                         f"{type(profile).__name__}")
    arguments = loop_arguments(target, input_ids, **options)
    if not isinstance(tree, Mapping):
        return tree
    del arguments["tree"]
    checked = check_arguments(**arguments)
    drafter = checked.drafter
    spec = check_tree_spec(tree)
    if spec["kind"] == "auto" and spec.get("batch_sizes") is not None:  # a tree per batch size, measured here
        return per_batch_size(spec, target, checked, profile, arguments["acceptance"])
    # accuracy kinds use the drafter's measured profile (for "auto", under this rule and sampling; a chain τ it
    # lacks is measured on the first prompt where it can)
    return build_tree(tree, profile=profile, candidates=getattr(drafter, "candidates", "topk"),
                      acceptance=arguments["acceptance"], sampling=checked.sampling,
                      default=getattr(drafter, "default_tree", None), drafter=drafter, prompt=checked.first_prompt)


def per_batch_size(spec: dict, target, checked, profile: DrafterProfile | None, acceptance: str):
    """``{"kind": "auto", "batch_sizes": [...]}``: a TreesByBatch chosen from costs measured at each size
    (treespec/planning/batch_table.py), from what the profile predicts the drafter's τ with."""
    if checked.drafter is None:
        raise ValueError(f"tree spec {spec} chooses a drafter's trees per batch size, and no drafter was given")
    if profile is None:
        raise ValueError(f"tree spec {spec} needs the drafter's measured profile: "
                         "profile=treespec.heads.load_profile(source, target)")
    source = profile.tau_source("auto", getattr(checked.drafter, "candidates", "topk"), acceptance, checked.sampling,
                                checked.drafter, checked.first_prompt)
    if source is None:
        raise ValueError(f"tree spec {spec}: the profile holds nothing to predict this drafter's τ from (no rank "
                         "accuracies, no dry run)")
    if acceptance in CHAIN_RULES:
        source = chains_only(source)
    return plan_batch_table(target, checked.drafter, profile, source, spec["batch_sizes"], checked.first_prompt,
                            max_nodes=spec["max_nodes"])


def generate(target, input_ids, *, profile: DrafterProfile | None = None, **options) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after each prompt with tree speculation.

    ``input_ids``: one prompt ([P] or [1, P]), a batch [b, P] left-padded where ``attention_mask`` [b, P] is 0
    (transformers' convention), or a list of 1-D prompts, left-padded here with the pad id. Each row is
    decoded as if alone: greedy rows equal transformers' batched greedy ``generate`` on the same padded batch,
    sampled rows follow the target's distribution, each with its own draws from the one ``generator``.
    ``result.sequences`` [b, P + T] is shaped as transformers' output: the prompts as given, then each row's
    tokens and the pad id after its eos (``pad_token_id``, else the target's, else the first eos, else 0).

    ``tree`` is the candidate tree: a Tree, a DynamicTree or a tree-spec dict (default: the drafter's
    ``default_tree``); spec kinds "accuracy" and "auto" grow it from the drafter's measured ``profile``
    (treespec/planning/profile.py), before decoding starts (``plan_tree``); ``result.tree`` is the tree it chose.
    Every argument is checked first (treespec/inputs.py). ``acceptance`` is
    "rejection" (lossless: greedy at temperature 0, rejection sampling otherwise) or "typical"
    (Medusa's typical acceptance: faster, NOT lossless). ``observer`` (a ``treespec.timing.StepTimer``)
    fills the result's target and draft times; ``wall_time`` is always measured. ``compile=True`` runs the
    target's tree passes and a network drafter's depth steps as torch.compile'd static graphs, compiled once per
    shape (CUDA graphs on a GPU; a dict gives torch.compile's backend, mode, options: treespec/static_pass.py).
    """
    arguments = loop_arguments(target, input_ids, **options)
    arguments["tree"] = plan_tree(profile=profile, **arguments)
    return decode(**arguments)


# help() and inspect show the loop's arguments, a tree that may be a spec and ``profile``, which **options would hide
generate.__signature__ = LOOP.replace(parameters=[
    *(p.replace(annotation="Tree | DynamicTree | dict | None") if p.name == "tree" else p
      for p in LOOP.parameters.values()),
    inspect.Parameter("profile", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="DrafterProfile | None")])

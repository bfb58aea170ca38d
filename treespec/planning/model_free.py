"""Predicting a drafter without rank accuracies (the model-free kinds: prompt lookup, SuffixDecoding, Token Recycling,
REST, Lookahead): τ per tree and drafting cost from a short dry run on held-out prompts.

What each can draft, and so what its dry run decodes with (``candidate_trees``): chains γ = 1, 2, 3, 4, 6, 8 and its
own ``default_tree``. Prompt lookup is a chain drafter (its default is a chain; a branching tree only gets the
further n-gram matches as siblings); Token Recycling fills a fixed-shape template (its default, 12 nodes) or a chain
of its top ranks; SuffixDecoding, REST and Lookahead grow a dynamic budget (their default) or fill a static tree. A
drafter predicted this way is predicted on those trees only, and "auto" chooses among them or no speculation.

``measure_trees`` runs the dry run (treespec/planning/drafting_cost.py's ``dry_run``: the loop itself, each of the
drafter's calls timed by its ``CallTimer``) at the run's sampling and rule, and returns the ``MeasuredTrees`` (τ and the
sizes its passes verified, per tree) with the ``DraftingCost`` fitted over the same runs, as a trained drafter's is
over its calibration trees. ``model_free_profile`` adds this device's cost curve and engine cost, so the result is a
``DrafterProfile`` that generate()'s ``{"kind": "auto"}`` and ``treespec.planning.across.plan_across`` use as they use
a trained drafter's.
"""

from __future__ import annotations

import torch

from treespec.drafter import Drafter
from treespec.dynamic_tree import DynamicTree
from treespec.planning.autotree import DEFAULT_SIZES, CostModel, auto_chooser, cost_at, measure_cost_curve
from treespec.planning.drafting_cost import DraftingCost, drafting_fit, dry_run, own_text_prompts
from treespec.planning.engine_cost import measure_engine_cost
from treespec.planning.measured_tau import MeasuredTrees
from treespec.planning.profile import DrafterProfile
from treespec.planning.tree_spec import CHAIN_RULES
from treespec.sampling import Sampling
from treespec.tree import Tree

CHAINS = (1, 2, 3, 4, 6, 8)  # the chains a dry run decodes with, besides the drafter's own default tree
NEW_TOKENS = 48  # tokens each dry-run generation decodes: τ rises along a generation, so not too few


def candidate_trees(drafter: Drafter, acceptance: str = "rejection", chains=CHAINS) -> list[Tree | DynamicTree]:
    """The trees ``drafter`` is measured on (module docstring): chains no deeper than it fills, and its default tree;
    chains only under a rule that verifies chains (block)."""
    depth = drafter.max_tree_depth
    out: list[Tree | DynamicTree] = [Tree.chain(g) for g in chains if depth is None or g <= depth]
    default = drafter.default_tree
    if default is not None and len(default) and default not in out and \
            (acceptance not in CHAIN_RULES or (isinstance(default, Tree) and default.is_chain)):
        out.append(default)
    return out


def measure_trees(target, drafter: Drafter, prompts: list[torch.Tensor], *, trees=None,
                  sampling: Sampling | None = None, acceptance: str = "rejection", max_new_tokens: int = NEW_TOKENS,
                  seed: int = 0) -> tuple[MeasuredTrees, DraftingCost]:
    """(τ per tree, drafting cost) of ``drafter`` decoding ``prompts`` ([1, P] each: held-out text, never the prompts
    a prediction is checked on) over ``trees`` (None: ``candidate_trees``) at ``sampling`` (None: greedy) under
    ``acceptance``. A drafter that learns across generations (SuffixDecoding, Token Recycling) runs as a copy per tree
    (``dry_run``), so the dry run teaches the caller's drafter nothing and no tree sees a prompt's answer twice."""
    sampling = sampling or Sampling(0.0)
    trees = list(trees) if trees is not None else candidate_trees(drafter, acceptance)
    if acceptance in CHAIN_RULES and any(not (isinstance(t, Tree) and t.is_chain) for t in trees):
        raise ValueError(f"acceptance={acceptance!r} verifies chains only; the trees to measure hold "
                         f"{[t for t in trees if not (isinstance(t, Tree) and t.is_chain)]}")
    measured = dry_run(target, drafter, prompts, trees=trees, max_new_tokens=max_new_tokens,
                       sampling=sampling, acceptance=acceptance, seed=seed)
    return MeasuredTrees(measured.runs, sampling, acceptance), drafting_fit(measured)


def model_free_profile(target, drafter: Drafter, prompts: list[torch.Tensor] | None = None, *,
                       temperature: float = 0.0, top_p: float = 1.0, acceptance="rejection", trees=None,
                       sizes=DEFAULT_SIZES, max_new_tokens: int = NEW_TOKENS, log=print) -> DrafterProfile:
    """``drafter``'s profile on ``target`` on this device: its dry run on ``prompts`` (None: text the target writes
    itself; better, held-out prompts like the ones it will decode) under each rule of ``acceptance`` (one, or a list),
    the target's cost curve at the prompts' context, and the engine's cost per step. Measured now, not cached: a
    model-free drafter's τ is a property of the text it is given."""
    prompts = own_text_prompts(target) if prompts is None else list(prompts)
    if not prompts:
        raise ValueError("model_free_profile needs at least one held-out prompt to decode (None: the target's own "
                         "text)")
    sampling = Sampling(temperature, top_p)
    rules = [acceptance] if isinstance(acceptance, str) else list(acceptance)
    if not rules:
        raise ValueError("acceptance: an empty list (give a rule, or rules to measure under)")
    if len({int(n) for n in sizes}) < 2:  # one size gave a curve no tree's cost could be read from
        raise ValueError(f"sizes must be two or more different tree sizes (the curve is interpolated), got {sizes!r}")
    measured, fits = [], []
    for rule in rules:
        log(f"dry run of {type(drafter).__name__} under {rule}: {len(prompts)} prompts × its candidate trees")
        m, fit = measure_trees(target, drafter, prompts, trees=trees, sampling=sampling, acceptance=rule,
                               max_new_tokens=max_new_tokens)
        measured.append(m)
        fits.append(fit)
    context = max(p.shape[-1] for p in prompts) + max_new_tokens // 2
    curve = measure_cost_curve(target, tuple(sizes), past_len=context)
    fixed, per_depth, per_node = fits[0].on(cost_at(curve, 1))  # its drafting, on this curve's one-token pass
    costs = CostModel(curve, fixed, per_depth, cost_at(curve, 1), measure_engine_cost(target, past_len=context),
                      per_node)
    return DrafterProfile(tree_chooser=auto_chooser(costs), costs=costs, measured=measured)

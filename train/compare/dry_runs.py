"""A comparison's drafter that nothing else predicts (the model-free kinds; any drafter without rank accuracies or
chain τ: a reduced FR-Spec head, a combination), measured by a dry run on the workload's held-out prompts
(treespec/planning/model_free.py): τ per tree at the run's sampling, under each of the run's rules, and its drafting
cost per step fitted over the same generations. Its trees: the run's own trees it can draft (so each of its
configurations is predicted) and its candidate trees (chains and its default tree, which "auto" chooses among).
"""

from __future__ import annotations

from treespec.planning.drafting_cost import DraftingCost
from treespec.planning.model_free import candidate_trees, measure_trees
from treespec.planning.tree_spec import CHAIN_RULES, NEEDS_ACCURACY, build_tree
from treespec.sampling import Sampling
from treespec.train.compare.configurations import ACROSS_KEY, expand_specs
from treespec.tree import Tree

PROMPTS = 4  # held-out prompts a dry run decodes: a model-free drafter's τ varies a lot from prompt to prompt
MIN_TOKENS, MAX_TOKENS = 16, 64  # tokens each dry-run generation decodes: the run's budget, within these


def prompts_of(held, count: int = PROMPTS) -> list:
    """What a dry run decodes: the first ``count`` held-out prompts as a timed prompt is decoded, from its prompt on
    (the target's continuation is what the dry run decodes, as it is what decoding drafts against); a HeldOutText
    that kept none gives its whole windows."""
    if held.prompts:
        return list(held.prompts[:count])
    return [w[i : i + 1] for w, _ in held.pairs() for i in range(w.shape[0])][:count]


def trees_to_measure(drafter, specs: list[dict], rule: str) -> list:
    """``candidate_trees`` and the static and dynamic trees of ``specs`` that ``drafter`` can draft under ``rule``."""
    out = candidate_trees(drafter, rule)
    for spec in expand_specs(specs):
        if spec.get("kind") in NEEDS_ACCURACY or ACROSS_KEY in spec:
            continue
        tree = build_tree(spec, default=drafter.default_tree)
        drafts = isinstance(tree, Tree) or drafter.grows_dynamic_trees
        fits = drafter.max_tree_depth is None or tree.depth <= drafter.max_tree_depth
        chains = rule not in CHAIN_RULES or (isinstance(tree, Tree) and tree.is_chain)
        if len(tree) and drafts and fits and chains and tree not in out:
            out.append(tree)
    return out


def measure_dry_runs(target, label: str, drafter, prompts, specs: list[dict], rules: list[str], sampling: Sampling,
                     max_new_tokens: int, log=print) -> tuple[list, DraftingCost]:
    """(MeasuredTrees under each rule that an earlier one does not serve, the DraftingCost of the first) of
    ``drafter`` decoding ``prompts`` (held-out: never the timed ones)."""
    measured, cost = [], None
    tokens = max(MIN_TOKENS, min(MAX_TOKENS, max_new_tokens))
    for rule in rules:
        if any(m.serves(sampling, rule) for m in measured):
            continue  # at greedy, every lossless rule commits the same tokens
        trees = trees_to_measure(drafter, specs, rule)
        m, fit = measure_trees(target, drafter, prompts, trees=trees, sampling=sampling, acceptance=rule,
                               max_new_tokens=tokens)
        measured.append(m)
        cost = cost or fit
        log(f"dry run of {label} under {rule} ({len(prompts)} held-out prompts × {tokens} tokens): τ "
            + ", ".join(f"{tree_label(r.tree)} {r.tau:.2f}" for r in m.runs))
    return measured, cost


def tree_label(tree) -> str:
    if isinstance(tree, Tree):
        return f"chain γ={tree.depth}" if tree.is_chain else f"{len(tree)} nodes"
    return f"dynamic {tree.total_tokens}/{tree.depth}/{tree.top_k}"

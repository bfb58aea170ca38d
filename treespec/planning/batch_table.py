"""``tree={"kind": "auto", "batch_sizes": [1, 2, 4, 8, 16]}``: a tree per batch size, chosen from costs measured at
each size on this device, which generate() follows as rows finish (treespec/batch_trees.py).

At each size B the target's cost curve is timed over B × N tokens, the engine's cost per step at B rows
(engine_cost.py) and the drafter's drafting at B rows in the loop (drafting_cost.py); "auto" then picks, from the
drafter's profile (its rank accuracies, or τ per tree from a dry run), the tree with the best predicted tokens/s at
that size, or the empty tree where none is predicted to beat batched vanilla decoding. That is the table serving
engines keep by hand (speculation off above a batch-size threshold), measured here.

Measuring costs about 5-15 s per size on the reference models (two CPU cores); the costs are kept on the profile
(``DrafterProfile.batch_costs``), so later calls with the same sizes choose again without timing anything:

    profile = treespec.heads.load_profile("reference:eagle", target)
    out = generate(target, prompts, drafter=drafter, profile=profile, max_new_tokens=64,
                   tree={"kind": "auto", "batch_sizes": [1, 2, 4, 8, 16]})
    out.tree          # TreesByBatch({1: Tree(...), 2: ..., 16: Tree.chain(0)})
"""

from __future__ import annotations

import torch

from treespec.batch_trees import TreesByBatch, check_batch_sizes
from treespec.planning.autotree import CostModel, choose_tree, cost_at, cost_model, measure_cost_curve
from treespec.planning.drafting_cost import measure_drafting_cost
from treespec.planning.engine_cost import measure_engine_cost

#: tree tokens per row the cost curve is timed at, for each batch size
COST_SIZES = (1, 2, 4, 8, 16, 32)


def measure_batch_costs(target, drafter, prompts: list[torch.Tensor], batch_sizes, *, cost_sizes=COST_SIZES,
                        past_len: int = 256, log=print) -> dict[int, CostModel]:
    """{B: the CostModel of a step at B rows}: the target's curve over B × N tokens, the engine's cost per step at B
    rows and ``drafter``'s drafting at B rows, timed in the loop on ``prompts`` ([1, P] each)."""
    costs = {}
    for size in sorted(set(batch_sizes)):
        log(f"costs at batch size {size}: the target over {size} × N tokens, the engine and the drafter at {size} rows")
        curve = measure_cost_curve(target, cost_sizes, past_len=past_len, batch=size, repeats=5)
        engine = measure_engine_cost(target, past_len=past_len, batch=size, steps=8, repeats=2, ragged=True, log=log)
        fixed, per_depth, per_node = measure_drafting_cost(target, drafter, prompts[:2], batch=size).on(
            cost_at(curve, 1))
        costs[size] = cost_model(curve, per_depth, fixed, engine=engine, draft_cost_per_node=per_node)
    return costs


def choose_table(source, costs: dict[int, CostModel], max_nodes: int = 64) -> TreesByBatch:
    """The tree with the best predicted tokens/s at each size (``autotree.choose_tree`` on that size's costs; the
    empty tree where none beats vanilla decoding), from ``source`` (rank accuracies or a τ source)."""
    return TreesByBatch({size: choose_tree(source, c, max_nodes=max_nodes)[0].tree for size, c in costs.items()})


def plan_batch_table(target, drafter, profile, source, batch_sizes, prompt: torch.Tensor, *, max_nodes: int = 64,
                     log=print) -> TreesByBatch:
    """The table for ``tree={"kind": "auto", "batch_sizes": ...}`` (module docstring): the costs kept on
    ``profile`` where it holds every size, else measured now on ``prompt`` [1, P] and kept there; the trees from
    ``source`` (what the profile predicts this drafter's τ from, under this sampling and rule)."""
    sizes = check_batch_sizes(batch_sizes)
    held = getattr(profile, "batch_costs", None) or {}
    missing = [s for s in sizes if s not in held]
    if missing:
        held = {**held, **measure_batch_costs(target, drafter, [prompt], missing, log=log)}
        if profile is not None:
            profile.batch_costs = held
    return choose_table(source, {s: held[s] for s in sizes}, max_nodes)


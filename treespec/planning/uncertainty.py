"""Each prediction's own uncertainty, from the spread of the rounds its cost terms were timed in (robust.py).

A prediction divides vanilla's step (the target's one-token pass alone and the engine's vanilla term) by a speculative
step (the target's pass over the tree, timed after the drafter's calls, the drafting and the engine's fixed term).
Each was timed in rounds; after outliers are dropped, the kept rounds' range is where that term may lie on this
machine. ``bounded`` puts every term at the end of its range that favours speculation ("fast": vanilla's terms high,
the step's low) or vanilla ("slow"), and ``prediction_interval`` is the speedup under each: a conservative interval
(terms measured apart are taken at their ends together), which says how far the machine's own noise can move a
prediction, not how far the τ estimate can.

``bounds`` (JSON-able, what the comparison keeps per drafter): {"curve": {N: [lo, hi]} (the drafter's curve),
"baseline": [lo, hi] (the target's one-token pass alone), "engine_vanilla": [lo, hi], "engine_fixed": [lo, hi]}; a
term without bounds stays at its value, and a curve size without bounds (a tree's own size, timed apart) moves with
the median relative spread of the sizes that have them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from treespec.planning.autotree import CostModel, cost_at, predict


def bounded(costs: CostModel, bounds: dict, side: str) -> CostModel:
    """``costs`` with every bounded term at its ``side``'s end: "fast" (speculation's best case) or "slow"."""
    if side not in ("fast", "slow"):
        raise ValueError(f"side must be 'fast' or 'slow', got {side!r}")
    fast = side == "fast"
    bounds = check_bounds(bounds)

    def step_end(pair):  # a term of the speculative step: low when speculation is favoured
        return float(pair[0] if fast else pair[1])

    def vanilla_end(pair):  # a term of vanilla's step: high when speculation is favoured
        return float(pair[1] if fast else pair[0])

    spread = {int(n): pair for n, pair in (bounds.get("curve") or {}).items()}
    known = [step_end(pair) / costs.curve[n] for n, pair in spread.items() if costs.curve.get(n)]
    ratio = statistics.median(known) if known else 1.0
    curve = {n: step_end(spread[n]) if n in spread else t * ratio for n, t in costs.curve.items()}
    baseline = cost_at(costs.curve, 1) if costs.baseline is None else costs.baseline  # vanilla's own, never the step's
    if bounds.get("baseline") is not None:
        baseline = vanilla_end(bounds["baseline"])
    engine = costs.engine
    if bounds.get("engine_vanilla") is not None:
        engine = dataclasses.replace(engine, vanilla=vanilla_end(bounds["engine_vanilla"]))
    if bounds.get("engine_fixed") is not None:
        engine = dataclasses.replace(engine, fixed=step_end(bounds["engine_fixed"]))
    return dataclasses.replace(costs, curve=curve, baseline=baseline, engine=engine)


def check_bounds(bounds) -> dict:
    """``bounds`` (module docstring; None: {}) with every pair two finite numbers lo <= hi and every curve size a whole
    number, else a ValueError naming the term (a pair of one once raised an IndexError, reversed ends gave an
    inverted interval)."""
    bounds = {} if bounds is None else bounds
    if not isinstance(bounds, dict):
        raise ValueError(f"bounds must be a dict of terms' [lo, hi] (module docstring), got {type(bounds).__name__}")
    pairs = [(f"curve[{n!r}]", pair) for n, pair in (bounds.get("curve") or {}).items()]
    pairs += [(term, bounds[term]) for term in ("baseline", "engine_vanilla", "engine_fixed")
              if bounds.get(term) is not None]
    for what, pair in pairs:
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
        if not ok or pair[0] > pair[1]:
            raise ValueError(f"bounds: {what} must be [lo, hi], two finite numbers with lo <= hi, got {pair!r}")
    for n in bounds.get("curve") or {}:
        if not str(n).isdigit():
            raise ValueError(f"bounds: the curve's sizes must be whole numbers of tree tokens, got {n!r}")
    return bounds


def prediction_interval(tree, source, costs: CostModel, bounds: dict | None) -> tuple:
    """(the prediction at the "slow" ends, at the "fast" ends) of ``tree`` (autotree.Prediction each), or None
    without bounds."""
    if not bounds:
        return None
    return predict(tree, source, bounded(costs, bounds, "slow")), predict(tree, source, bounded(costs, bounds, "fast"))


def spread_pairs(spreads: dict) -> dict:
    """{N: [lo, hi]} of {N: robust.Spread} (JSON-able)."""
    bad = {n: s for n, s in (spreads.items() if isinstance(spreads, dict) else [(None, spreads)])
           if not (hasattr(s, "lo") and hasattr(s, "hi"))}
    if bad:
        raise TypeError(f"spread_pairs takes {{size: robust.Spread}}, got {str(bad)[:80]}")
    return {int(n): [s.lo, s.hi] for n, s in spreads.items()}

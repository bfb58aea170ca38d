"""Checks on a cost record (``autotree.cost_curve_record``: what a drafter's cost_curve.json and a profile-cache
entry hold), run where one is read and where one is written.

``tree=auto`` chooses from these numbers and nothing else looks at them, so a bad one silently picks the wrong
tree. What cannot be a measurement is refused, naming the file: a cost that is not a number, NaN or infinite,
a size that is not a whole number of tokens, a target pass of 0 s or less, a curve timed at fewer than two
sizes (a tree's cost is interpolated between them), a negative term larger than a one-token pass. What is
possible but unlikely gets a warning that names the file: a slightly negative term (the engine's and the drafting
terms are an in-loop median minus a pass timed alone, which a busy machine can push below 0; it is read as 0), a
term over ``RATIO`` one-token passes (milliseconds where seconds belong), a larger pass costing under 1/``RATIO`` of
a smaller one, or over ``RATIO`` times its share of tokens.
"""

from __future__ import annotations

import math
import warnings

TERMS = ("draft_cost_fixed", "draft_cost_per_depth", "draft_cost_per_node", "engine_vanilla", "engine_fixed",
         "engine_per_node")
RATIO = 10.0  # how far from a one-token pass a term may be before it is flagged


def seconds(value, what: str, where) -> float:
    """``value`` as seconds; a non-number, NaN or infinity is an error naming ``what`` and ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"cost record {where}: {what} must be seconds (a number), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"cost record {where}: {what} is {value}, not a time: measure it again")
    return float(value)


def tree_size(key, where) -> int:
    text = str(key).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"cost record {where}: the curve's sizes must be whole numbers of tree tokens >= 1, got "
                         f"{key!r}")
    return int(text)


def check_cost_record(record, where, *, measured: bool = False) -> dict:
    """``record`` with its curve's sizes as ints and every cost checked (module docstring): slightly negative
    terms read as 0; ``where`` (the file) is named in every error and warning. ``measured``: a measurement just
    taken, being written: any negative engine term is then a busy machine's noise (a step's median minus a pass
    timed alone), stored as 0 with a warning rather than failing the job that measured it (a training's end)."""
    if not isinstance(record, dict) or not isinstance(record.get("curve"), dict) or not record["curve"]:
        raise ValueError(f"cost record {where} must hold {{\"curve\": {{tree tokens: seconds}}, ...}}, got "
                         f"{str(record)[:80]}")
    curve = {tree_size(n, where): seconds(t, f"the cost of a pass over {n} tokens", where)
             for n, t in record["curve"].items()}
    if min(curve.values()) <= 0:
        raise ValueError(f"cost record {where}: a target pass cannot take 0 s or less, got {record['curve']}")
    if len(curve) < 2:
        raise ValueError(f"cost record {where} was timed at one size only ({record['curve']}): a tree's cost is "
                         "interpolated between two sizes or more; measure it again with more (cost_sizes)")
    sizes = sorted(curve)
    one = curve[sizes[0]]
    for small, big in zip(sizes, sizes[1:], strict=False):
        if curve[big] * RATIO < curve[small]:
            warnings.warn(f"cost record {where}: a pass over {big} tokens ({curve[big]:.3g} s) costs under "
                          f"1/{RATIO:g} of one over {small} ({curve[small]:.3g} s); measure it again", stacklevel=3)
        elif curve[big] > RATIO * big / small * curve[small]:  # more than RATIO x its tokens' share: 1e300 s once
            warnings.warn(f"cost record {where}: a pass over {big} tokens ({curve[big]:.3g} s) costs over "
                          f"{RATIO * big / small:g} passes over {small} ({curve[small]:.3g} s); measure it again",
                          stacklevel=3)
    out = dict(record, curve=curve)
    if record.get("baseline") is not None:
        out["baseline"] = seconds(record["baseline"], "baseline", where)
        if out["baseline"] <= 0:
            raise ValueError(f"cost record {where}: the one-token pass (baseline) cannot take {out['baseline']} s")
    for term in TERMS:
        if record.get(term) is None:  # a file written before that term was measured: 0
            continue
        value = out[term] = seconds(record[term], term, where)
        if value < -one and not measured:
            raise ValueError(f"cost record {where}: {term} = {value} s, more negative than a whole one-token pass "
                             f"({one:.3g} s): not a measurement")
        if value < 0:  # step minus pass alone, each a median: a busy machine's noise
            warnings.warn(f"cost record {where}: {term} = {value:.3g} s is below 0 (noise of a busy machine?): "
                          "read as 0", stacklevel=3)
            out[term] = 0.0
        elif value > RATIO * one:
            warnings.warn(f"cost record {where}: {term} = {value:.3g} s is {value / one:.0f} one-token passes "
                          f"({one:.3g} s): written in ms instead of s?", stacklevel=3)
    return out

"""Timings that survive a noisy machine: a cost term timed in several rounds is the median of the rounds left after
those further than ``K`` scaled median absolute deviations from their median are dropped, and the kept rounds' range
is its spread (``Spread``), which predictions carry as their uncertainty (treespec/planning/uncertainty.py).

Why: on a shared machine a slow spell lasts seconds to minutes. Every term is already timed in rounds interleaved with
the others (the cost curve's sizes, the engine's vanilla and tree steps, a drafter's trees), so a spell falls on a few
rounds of each term rather than on one term whole; a plain median of three rounds still moves when two of them fall in
it (the engine's vanilla term once came out at 3.5 ms against 0.4-1.0 ms in every other run, docs/results.md). Dropping
rounds beyond k·MAD keeps the median where the quiet rounds are, and the kept rounds' range says how sure it is.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

K = 3.0            # rounds further than K scaled MADs from the median are outliers (3: a normal round almost never)
MAD_SCALE = 1.4826  # the MAD of normal noise times this is its standard deviation


@dataclass(frozen=True)
class Spread:
    """A term from its rounds: ``value`` (the median of the kept rounds), ``lo`` and ``hi`` (their range),
    ``kept`` and ``dropped`` rounds."""

    value: float
    lo: float
    hi: float
    kept: int
    dropped: int = 0

    def scaled(self, factor: float) -> Spread:
        return Spread(self.value * factor, self.lo * factor, self.hi * factor, self.kept, self.dropped)


def robust(values, k: float = K) -> Spread:
    """The ``Spread`` of ``values`` (one per round) without the rounds beyond ``k`` scaled MADs of their median. With
    a MAD of 0 (most rounds alike) only rounds equal to the median are kept; with one or two rounds nothing is
    dropped (no deviation to judge by)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("a term needs at least one timed round")
    if any(math.isnan(v) for v in values):  # a median over NaN depends on where it falls
        raise ValueError(f"a timed round is NaN: {values}")
    if not (isinstance(k, (int, float)) and k >= 1):  # a smaller k can drop every round (no median of nothing)
        raise ValueError(f"k (outliers lie beyond k scaled MADs) must be a number >= 1, got {k!r}")
    if len(values) <= 2:
        return Spread(statistics.median(values), min(values), max(values), len(values))
    middle = statistics.median(values)
    mad = MAD_SCALE * statistics.median(abs(v - middle) for v in values)
    kept = [v for v in values if abs(v - middle) <= k * mad]
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept), len(values) - len(kept))


def robust_median(values, k: float = K) -> float:
    """``robust(values, k).value``."""
    return robust(values, k).value

"""Bootstrap intervals for the comparison's report (train/compare/report.py): per configuration, the median
speedup and τ with a percentile interval over prompts.

Prompts are the unit that varies most (how predictable the text is), so resampling is by prompt (a
cluster bootstrap): each resample draws prompts with replacement and keeps all of a drawn prompt's
repeats, or all of its verification passes for τ. With a single prompt the repeats (or passes) are
resampled on their own. Every configuration of a run is resampled with the same prompt draws (one seed),
so intervals of different configurations are comparable.

Percentile intervals of a median undercover with few prompts (with 3 prompts the interval is simply the
smallest to the largest per-prompt value); the report prints the number of prompts beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval; ``lo``/``hi`` are None when nothing could be resampled
    (a single value), ``value`` is NaN when there is no value at all."""

    value: float
    lo: float | None = None
    hi: float | None = None
    n: int = 0                          # clusters (prompts) the interval resamples

    @property
    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None

    def overlaps(self, other: Estimate) -> bool:
        """Whether the two intervals share a point (a missing interval is its point estimate)."""
        if math.isnan(self.value) or math.isnan(other.value):
            return False
        a_lo, a_hi = (self.lo, self.hi) if self.has_interval else (self.value, self.value)
        b_lo, b_hi = (other.lo, other.hi) if other.has_interval else (other.value, other.value)
        return a_lo <= b_hi and b_lo <= a_hi

    def half_width(self) -> float:
        """Half the interval's width relative to the value (0.1: ±10 %); NaN without an interval."""
        if not self.has_interval or not self.value:
            return math.nan
        return (self.hi - self.lo) / 2 / abs(self.value)


def _draws(n: int, samples: int, seed: int) -> np.ndarray:
    """[samples, n] indices in 0..n-1, the same for every statistic of a run (one seed)."""
    return np.random.default_rng(seed).integers(0, n, size=(samples, n))


def _interval(boot: np.ndarray, value: float, level: float) -> tuple[float, float]:
    """The percentile interval, widened to hold the point estimate (percentile intervals of skewed
    statistics can miss it; widening only makes the interval more cautious)."""
    boot = boot[np.isfinite(boot)]
    tail = (1 - level) / 2
    lo, hi = np.quantile(boot, [tail, 1 - tail])
    return float(min(lo, value)), float(max(hi, value))


def groups_of(values: list, prompt_of_run: list[int] | None) -> list[list]:
    """Per-run values grouped by the prompt each run decoded (runs are prompts × repeats, in order)."""
    if prompt_of_run is None:
        prompt_of_run = list(range(len(values)))
    if len(prompt_of_run) != len(values):
        raise ValueError(f"{len(values)} runs but {len(prompt_of_run)} prompt indices")
    out: dict[int, list] = {}
    for p, v in zip(prompt_of_run, values, strict=True):
        out.setdefault(p, []).append(v)
    return [out[p] for p in sorted(out)]


def median_interval(groups: list[list[float]], *, samples: int = 2000, level: float = 0.95,
                    seed: int = 0) -> Estimate:
    """The median of all values with a bootstrap interval over groups (prompts), repeats kept together."""
    groups = [[float(v) for v in g] for g in groups if len(g)]
    flat = [v for g in groups for v in g]
    if not flat or not all(math.isfinite(v) for v in flat):
        return Estimate(math.nan)
    value = float(np.median(flat))
    if len(groups) < 2:                 # one prompt: resample its repeats
        groups = [[v] for v in flat]
    if len(groups) < 2:
        return Estimate(value, n=1)
    draws = _draws(len(groups), samples, seed)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1:                 # equal repeats per prompt (always, from the harness): vectorised
        boot = np.median(np.asarray(groups)[draws].reshape(samples, -1), axis=1)
    else:
        boot = np.array([np.median([v for i in row for v in groups[i]]) for row in draws])
    return Estimate(value, *_interval(boot, value, level), n=len(groups))


def tau_interval(groups: list[list[list[int]]], *, samples: int = 2000, level: float = 0.95,
                 seed: int = 0) -> Estimate:
    """τ (mean tokens committed per verification pass, over all passes) with a bootstrap interval over
    prompts; ``groups[p]`` holds prompt p's runs, each a list of accept lengths."""
    sums = np.array([sum(sum(run) for run in g) for g in groups], dtype=float)
    counts = np.array([sum(len(run) for run in g) for g in groups], dtype=float)
    if counts.sum() == 0:
        return Estimate(math.nan)
    value = float(sums.sum() / counts.sum())
    if len(groups) < 2:                 # one prompt: resample its passes
        passes = [n for g in groups for run in g for n in run]
        sums, counts = np.array(passes, dtype=float), np.ones(len(passes))
    if len(sums) < 2:
        return Estimate(value, n=1)
    draws = _draws(len(sums), samples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = sums[draws].sum(1) / counts[draws].sum(1)
    return Estimate(value, *_interval(boot, value, level), n=len(groups))


def throughput_ratio_interval(groups: list[list[tuple[float, float, float, float]]], *, samples: int = 2000,
                              level: float = 0.95, seed: int = 0) -> Estimate:
    """Spec-Bench's speedup, (Σ a method's tokens ÷ Σ its seconds) ÷ (the same of vanilla), with a bootstrap
    interval over prompts; ``groups[p]`` holds prompt p's runs, each (method tokens, method seconds, vanilla
    tokens, vanilla seconds). With the same tokens (greedy) it is vanilla's total time ÷ the method's."""
    sums = np.array([[sum(run[k] for run in g) for k in range(4)] for g in groups if g], dtype=float)
    if not len(sums) or (sums[:, 1].sum() <= 0) or (sums[:, 3].sum() <= 0) or not np.isfinite(sums).all():
        return Estimate(math.nan)
    ratio = lambda s: (s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3])  # noqa: E731 - one line, used twice
    value = float(ratio(sums.sum(0)))
    if len(sums) < 2 or samples < 1:  # one prompt, or a point asked for
        return Estimate(value, n=len(sums))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = ratio(sums[_draws(len(sums), samples, seed)].sum(1))
    return Estimate(value, *_interval(boot, value, level), n=len(sums))

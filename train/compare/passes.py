"""One pass of the comparison over its prompts: bench.measure once per generation budget (prompts sharing one are
measured together, each group's prompts × repeats in turn), the groups' rows merged into one Row per
configuration. Runs are numbered in measuring order, which is fixed by the budgets and repeats alone, so a resumed
comparison (train/compare/journal.py) finds each journaled run where it left it.
"""

from __future__ import annotations

import math
import statistics

import torch

from treespec.planning.bench import Config, Row, measure


def merge_rows(parts: list[list[Row]]) -> list[Row]:
    """One Row per configuration from the rows of several bench.measure calls on disjoint prompts (same
    configurations, same order): per-prompt lists concatenated, medians and τ over all of them."""
    if len(parts) == 1:
        return parts[0]
    out = []
    for rows in zip(*parts, strict=True):
        runs = [len(r.prompt_speedups) for r in rows]
        passes = sum(r.target_passes for r in rows)
        lengths = [n for r in rows for n in r.accept_lengths]
        overhead = [(r.overhead_fraction, k) for r, k in zip(rows, runs, strict=True)
                    if not math.isnan(r.overhead_fraction)]
        drafting = [(r.draft_time_per_pass, r.target_passes) for r in rows if not math.isnan(r.draft_time_per_pass)]
        walking = [(r.walk_time_per_pass, r.target_passes) for r in rows if not math.isnan(r.walk_time_per_pass)]
        out.append(Row(
            name=rows[0].name,
            tokens_per_s=statistics.median(x for r in rows for x in r.prompt_tokens_per_s),
            speedup=statistics.median(x for r in rows for x in r.prompt_speedups),
            tau=sum(lengths) / len(lengths) if lengths else math.nan,
            target_passes=passes, new_tokens=sum(r.new_tokens for r in rows),
            overhead_fraction=sum(f * k for f, k in overhead) / sum(k for _, k in overhead) if overhead else math.nan,
            accept_lengths=lengths,
            prompt_tokens_per_s=[x for r in rows for x in r.prompt_tokens_per_s],
            prompt_speedups=[x for r in rows for x in r.prompt_speedups],
            prompt_accept_lengths=[x for r in rows for x in r.prompt_accept_lengths],
            prompt_new_tokens=[x for r in rows for x in r.prompt_new_tokens],
            draft_time_per_pass=sum(t * p for t, p in drafting) / max(1, sum(p for _, p in drafting)) if drafting
            else math.nan,
            walk_time_per_pass=sum(t * p for t, p in walking) / max(1, sum(p for _, p in walking)) if walking
            else math.nan))
    return out


def budget_groups(budgets: list[int], repeats: int) -> dict[int, list[int]]:
    """{budget: the prompt of each of its runs}: prompts sharing a generation budget are measured together, each
    group's prompts × ``repeats`` in turn; the groups one after another give the measuring order."""
    groups: dict[int, list[int]] = {}
    for i, budget in enumerate(budgets):
        groups.setdefault(int(budget), []).append(i)
    return {budget: idx * repeats for budget, idx in groups.items()}


def measuring_order(budgets: list[int], repeats: int) -> list[int]:
    """The prompt of every prompt run, in the order the comparison measures them (results.json's prompt_of_run)."""
    return [i for runs in budget_groups(budgets, repeats).values() for i in runs]


def measure_by_budget(target, configs: list[Config], prompts: list[torch.Tensor], budgets: list[int], *, repeats: int,
                      progress=None, on_prompt=None, restored=None, on_run=None,
                      **kwargs) -> tuple[list[Row], list[int]]:
    """bench.measure over ``prompts`` × ``repeats``, one call per generation budget (prompts sharing one are
    measured together); returns the merged rows and the prompt index of every run, in measuring order.
    ``on_prompt(rows, prompt_of_run)`` gets what has been measured so far after every prompt run. Runs are
    numbered k in measuring order: ``restored[(k, name)]`` is a run measured before (bench.measure's ``done``),
    ``on_run(k, prompt, name, measured)`` and ``progress(name, k)`` follow each new one."""
    done: list[list[Row]] = []
    order: list[int] = []
    seed = kwargs.pop("seed", 0)
    restored = restored or {}
    for budget, runs in budget_groups(budgets, repeats).items():
        before = list(order)

        def handover(partial, before=before, runs=runs):
            if on_prompt is not None:
                k = len(partial[0].prompt_speedups)
                on_prompt(merge_rows(done + [partial]), before + runs[:k])

        first = len(order)  # run j of this group is run first + j of the comparison
        # prompt i of a group is tagged seed + its position: offset so no two groups share generator seeds
        done.append(measure(
            target, configs, [prompts[i] for i in runs], max_new_tokens=budget, seed=seed + first,
            progress=None if progress is None else lambda name, j, first=first: progress(name, first + j),
            on_prompt=handover, done={(k - first, name): m for (k, name), m in restored.items()
                                      if first <= k < first + len(runs)},
            on_run=None if on_run is None else
            lambda j, name, m, first=first, runs=runs: on_run(first + j, runs[j], name, m), **kwargs))
        order += runs
    return merge_rows(done), order

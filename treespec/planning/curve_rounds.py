"""The target's cost curve timed in rounds: every size's forward times, one per round, sizes interleaved forward by
forward (``cost_curve_rounds``). autotree.measure_cost_curve takes each size's robust median (robust.py); the
comparison keeps each size's spread too, which its predictions carry (uncertainty.py).
"""

from __future__ import annotations

import time

from treespec.timing import forward_steps, wait_for


def cost_curve_rounds(model, sizes, past_len: int = 256, repeats: int = 10, before=None, batch: int = 1
                      ) -> dict[int, list[float]]:
    """{N: seconds of each timed forward over N new tokens per row after ``past_len`` cached ones, ``batch`` rows},
    2 × ``repeats`` rounds after an untimed one (lazy initialisation). ``before``: a call run untimed ahead of each
    forward (a drafter's drafting call)."""
    # sizes interleaved forward by forward (up, then down), so a shared machine's slow spell falls on every size alike
    # and bends no part of the curve. Timed size by size, a spell on one size once put a pass over 5 tokens below one
    # over 4 (docs/results.md, "Drafting measured in the loop")
    sizes = sorted({int(n) for n in sizes})
    steps = forward_steps(model, sizes, past_len, batch=batch)
    times = {n: [] for n in sizes}
    for round_ in range(2 * repeats + 1):
        for n in sizes if round_ % 2 == 0 else sizes[::-1]:
            if before is not None:
                before()
            wait_for()
            start = time.perf_counter()
            steps[n]()
            wait_for()
            if round_:
                times[n].append(time.perf_counter() - start)
    return times

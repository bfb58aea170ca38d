"""Timing, kept out of the decoding loop: an optional observer of one generate() call, and the median
timings of single forwards that cost curves and drafting costs are made of.

CUDA kernels run asynchronously, so a host clock read right after a call measures its launch, not its
work. A measurement therefore waits for the device (``torch.cuda.synchronize``) at every boundary, which
serialises it: that is right for a comparison, which charges each part for its own kernels, and wrong for
production decoding. So generate() never synchronises by itself; ``StepTimer(synchronize=True)``, passed
as its ``observer``, does.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from treespec.cache import TreeCache
from treespec.compat import cache_arg

# the parts a StepTimer charges: target forwards, drafter calls that propose a tree, drafter calls that update its
# state from a verified pass (an index's update: observe_pass, accept), the walker (walker.py) over a pass's logits
TARGET, DRAFT, UPDATE, WALK = "target", "draft", "update", "walk"


def wait_for(device=None) -> None:
    """Wait for the kernels queued on ``device`` (None: the current CUDA device); a no-op without CUDA."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


class StepTimer:
    """An observer of one generate() call (a fresh one per call: its totals add up): seconds inside the
    target's forwards, the drafter's calls (proposing, updating) and the walker.

    generate() wraps each of those calls in ``timing(TARGET)``, ``timing(DRAFT)``, ... and reads its wall clock
    from ``clock()``, only when given an observer. With ``synchronize`` each boundary first waits for the
    kernels queued on ``device`` (the target's), so each part is charged for its own kernels."""

    def __init__(self, synchronize: bool = True, device=None):
        self.synchronize, self.device = synchronize, device
        self.seconds = {TARGET: 0.0, DRAFT: 0.0, UPDATE: 0.0, WALK: 0.0}

    def clock(self) -> float:
        if self.synchronize:
            wait_for(self.device)
        return time.perf_counter()

    @contextmanager
    def timing(self, part: str):
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[part] += self.clock() - start


def timed(observer: StepTimer | None, part: str):
    """``observer.timing(part)``, or nothing without an observer."""
    return nullcontext() if observer is None else observer.timing(part)


def clock(observer: StepTimer | None) -> float:
    """The observer's clock, or a plain host clock (no synchronisation) without one."""
    return time.perf_counter() if observer is None else observer.clock()


def clocked(call: Callable, name: str, spent: dict[str, float]) -> Callable:
    """``call`` with a clock around it that adds its seconds to ``spent[name]`` (where a pass's time goes, by call:
    the results scripts that split a pass)."""
    def timed_call(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return out
    return timed_call


def clocked_passes(step: Callable[[], object], spent: dict[str, float], passes: int = 8) -> dict[str, float]:
    """Milliseconds per call of ``step`` under each name its ``clocked`` calls add to ``spent``, and the whole call's
    ("whole pass"), over ``passes`` calls."""
    spent.clear()
    start = time.perf_counter()
    for _ in range(passes):
        step()
    spent["whole pass"] = time.perf_counter() - start
    return {name: seconds / passes * 1e3 for name, seconds in spent.items()}


def memory_probe(megabytes: int = 256) -> Callable[[], float]:
    """A call that measures this machine's memory streaming rate now, in GB/s: one row multiplied against
    ``megabytes`` of distinct weights (each read from memory once), through the packed kernel where it builds, else
    ``F.linear``. The results scripts tag each round with it: a VM's memory streams faster with its two CPUs on two
    core complexes than on one (results/smollm2_states/)."""
    from treespec import native_linear  # a measuring helper: the kernel library only when asked for

    packed = native_linear.packed_available()
    count = max(1, int(megabytes * 1e6 // (1536 * 576 * 4)))
    weights = [torch.randn(1536, 576) for _ in range(count)]
    weights = [native_linear.pack(w) for w in weights] if packed else weights
    row = torch.randn(1, 576)

    def multiply(weight: torch.Tensor) -> torch.Tensor:
        return native_linear.packed_linear(row, weight, 1536) if packed else torch.nn.functional.linear(row, weight)

    def rate() -> float:
        start = time.perf_counter()
        for weight in weights:
            multiply(weight)
        return count * 1536 * 576 * 4 / (time.perf_counter() - start) / 1e9

    return rate


def median_time(fn: Callable[[], object], repeats: int = 30, warmup: int = 2,
                before: Callable[[], object] | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones. ``before()``, untimed, runs
    ahead of every call: timing a target pass right after a drafting call (or the reverse) finds the weights
    the other one pushed out of the caches, as decoding does."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        wait_for()  # on both sides of the timed call
        t0 = time.perf_counter()
        fn()
        wait_for()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_time(model, n_tokens: int = 1, past_len: int = 256, repeats: int = 30, *, preallocate: bool = True,
                 before: Callable[[], object] | None = None, batch: int = 1) -> float:
    """Median seconds of one forward over ``n_tokens`` new tokens per row after ``past_len`` cached ones, for
    ``batch`` rows, with the cache generate() verifies with (``preallocate=False``: transformers' concatenating
    layers); ``before`` as in ``median_time``."""
    return median_time(forward_step(model, n_tokens, past_len, preallocate=preallocate, batch=batch), repeats,
                       before=before)


def forward_step(model, n_tokens: int = 1, past_len: int = 256, *, preallocate: bool = True,
                 batch: int = 1) -> Callable[[], None]:
    """A call that runs one forward over ``n_tokens`` new tokens per row after ``past_len`` cached ones, for
    ``batch`` rows, for timing."""
    return forward_steps(model, [n_tokens], past_len, preallocate=preallocate, batch=batch)[n_tokens]


@torch.no_grad()
def forward_steps(model, sizes, past_len: int = 256, *, preallocate: bool = True, batch: int = 1
                  ) -> dict[int, Callable[[], None]]:
    """{N: a call that runs one forward over N new tokens per row after ``past_len`` cached ones} for each of
    ``sizes``, for ``batch`` rows, all on one cache of that prefix (each call leaves it as it found it)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (batch, past_len), generator=gen).to(model.device)
    cache = TreeCache(model.config, preallocate=preallocate)
    model(input_ids=prefix, **cache_arg(cache), use_cache=True)

    def step_of(n_tokens: int) -> Callable[[], None]:
        new = torch.randint(0, vocab, (batch, n_tokens), generator=gen).to(model.device)

        @torch.no_grad()
        def step():  # the new tokens' entries are dropped again so every call sees past_len cached ones
            model(input_ids=new, **cache_arg(cache), use_cache=True)
            cache.crop(-n_tokens)  # transformers 5: a negative count removes the newest entries

        return step

    return {int(n): step_of(int(n)) for n in sizes}


def busy_cores(cores: int, seconds: float = 0.5) -> float | None:
    """How many cores other work keeps busy now: the non-idle share of /proc/stat's CPU time over ``seconds``,
    times ``cores``; None where /proc/stat is missing. Not the load average: its minute-long memory still counts a
    job that just ended (``scripts/setup.sh``'s pip, an earlier run), and a run started right after one took a
    single thread of an idle machine."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return cores * (1 - (idle1 - idle0) / (total1 - total0))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

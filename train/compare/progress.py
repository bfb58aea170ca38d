"""What a user watching a comparison sees, and what it runs with: the threads default on a shared machine and the
progress lines (runs done of all, which prompt run, the time left; ``Countdown`` for the phases before the runs:
the target's greedy answers of a workload's earlier turns, its held-out continuations).

Threads: torch starts one thread per core. On cores that other processes keep busy those threads wait for each
other at every operation, and a forward slows several-fold. So ``threads: null`` takes the cores that other work
leaves idle right now (``timing.busy_cores``: /proc/stat's busy share over half a second; the load average where
that is missing), and says so.
"""

from __future__ import annotations

import os
import time

import torch

from treespec.timing import busy_cores, usable_cores


def default_threads(device: str = "cpu") -> tuple[int | None, str]:
    """(threads for ``threads: null``, the line that says why): the cores this process may use minus the cores
    other work keeps busy (``busy_cores``; the 1-minute load average where /proc/stat is missing), at least 1.
    None (torch's own choice) off the CPU, when ``OMP_NUM_THREADS`` chooses, or where neither measure exists."""
    if not str(device).startswith("cpu"):
        return None, ""
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"threads: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} (threads=N sets them)"
    cores = usable_cores()
    busy, what = busy_cores(cores), "busy now"
    if busy is None:
        try:
            busy, what = os.getloadavg()[0], "load average"
        except (AttributeError, OSError):
            return None, ""
    threads = max(1, min(cores, cores - int(busy + 0.5)))
    return threads, (f"threads: {threads} ({cores} cores, {busy:.1f} {what} before this run; threads=N sets them)")


def set_threads(threads: int | None, device: str = "cpu", log=print) -> None:
    """torch's threads: ``threads``, or for None ``default_threads``; the choice is printed."""
    threads, why = (threads, f"threads: {threads}") if threads else default_threads(device)
    if threads:
        torch.set_num_threads(threads)
    if why:
        log(why)


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: "40 s", "3 min 10 s", "1 h 05 min"."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """The line logged after each run: "[done/total] configuration · prompt run r/R · about T left".

    ``total`` counts every run of the comparison (configurations and vanilla × prompt runs, the peers' pass
    too); ``done`` those an earlier process measured (a resume). The time left extrapolates this process's own
    runs: runs differ in length (trees, end tokens), so it is a rough guide that settles as the run goes."""

    def __init__(self, total: int, runs: int, done: int = 0, log=print, clock=time.perf_counter):
        self.total, self.runs, self.done, self.log, self.clock = total, runs, done, log, clock
        self.fresh, self.first = 0, None

    def __call__(self, name: str, run: int) -> None:
        self.done += 1
        self.fresh += 1
        left, now = max(0, self.total - self.done), self.clock()
        if self.first is None:  # the first run's time holds the warm-up: estimates start from the second
            self.first = now
            eta = "time left: from the next run on" if left else "the last run"
        else:
            eta = f"about {duration((now - self.first) / (self.fresh - 1) * left)} left" if left else "the last run"
        self.log(f"  [{self.done}/{self.total}] {name} · prompt run {run + 1}/{self.runs} · {eta}")


class Countdown:
    """The line logged after each item of a phase that precedes the timed runs: "  <what> [done/total] · <note> ·
    about T left", the time left extrapolated from the items done so far."""

    def __init__(self, what: str, total: int, log=print, clock=time.perf_counter):
        self.what, self.total, self.log, self.clock = what, total, log, clock
        self.done, self.start = 0, clock()

    def __call__(self, note: str = "") -> None:
        self.done += 1
        left = max(0, self.total - self.done)
        spent = self.clock() - self.start
        eta = f"about {duration(spent / self.done * left)} left" if left else "done"
        self.log(f"  {self.what} [{self.done}/{self.total}]" + (f" · {note}" if note else "") + f" · {eta}")

"""Where this VM's two CPUs sit, against what SmolLM2's passes cost, round by round: a cache line's round trip
between CPU 0 and CPU 1 (round_trip.c: ~55-100 ns on one core complex, ~330-600 ns across two), the memory's
streaming rate (the packed kernel, one row over 256 MB of weights), and T(1), T(16) after 256 cached tokens on the
default kernels. Rounds whose round trips before and after disagree (the VM moved meanwhile) are marked "moved";
each round trip is measured after a pause, once torch's OpenMP worker has stopped spinning on CPU 1.

    python results/smollm2_states/placement.py [rounds=30]
"""

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from treespec import reference
from treespec.timing import forward_steps, median_time, memory_probe

rounds = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("rounds", 30))
torch.set_num_threads(2)
library = Path(tempfile.mkdtemp()) / "round_trip.so"
subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", str(Path(__file__).with_name("round_trip.c")), "-o",
                str(library)], check=True)
round_trip = ctypes.CDLL(str(library)).round_trip
round_trip.restype, round_trip.argtypes = ctypes.c_double, [ctypes.c_int]
target, _ = reference.load("smollm2")
steps = forward_steps(target, [1, 16], past_len=256)
stream_rate = memory_probe(256)


rows = []
print("round trip ns (before, after) | GB/s | T(1) T(16) ms | T(16)/T(1)")

def placement() -> float:
    """A round trip measured once torch's OpenMP worker has stopped spinning on CPU 1 after the last pass (it
    would share the CPU with the returner and inflate the time)."""
    time.sleep(0.05)
    return round_trip(200000)


for _ in range(rounds):
    before = placement()
    gbs = stream_rate()
    t1, t16 = (median_time(steps[n], repeats=3, warmup=1) * 1e3 for n in (1, 16))
    after = placement()
    state = "apart" if min(before, after) > 250 else "together" if max(before, after) < 250 else "moved"
    rows.append((state, gbs, t1, t16))
    print(f"{before:5.0f} {after:5.0f} {state:8s} | {gbs:4.1f} | {t1:5.1f} {t16:5.1f} | {t16 / t1:.2f}", flush=True)
for state in ("together", "apart", "moved"):
    chosen = [r for r in rows if r[0] == state]
    if chosen:
        gbs, t1, t16 = (statistics.median(c) for c in list(zip(*chosen, strict=True))[1:])
        ratios = sorted(r[3] / r[2] for r in chosen)
        print(f"{state}: {len(chosen)} rounds, medians {gbs:.1f} GB/s, T(1) {t1:.1f} ms, T(16) {t16:.1f} ms, "
              f"T(16)/T(1) {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")

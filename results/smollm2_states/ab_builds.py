"""The packed kernel of another commit against this checkout's, on SmolLM2's one-forward cost T(1) and T(16) after
256 cached tokens, alternated round by round in one process, each round tagged with this VM's state (its threads on
one core complex or two: the memory's streaming rate, 30-34 against 40-43 GB/s, measured that round).

Both versions of treespec/packed_linear.c are compiled as treespec/native_linear.py compiles it, into a temporary
folder, and swapped in as the packed kernel between rounds (the packed weights are the same layout in both).

    python results/smollm2_states/ab_builds.py --before ae9755f [--rounds 12]
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from treespec import native_linear, reference
from treespec.timing import forward_steps, median_time

parser = argparse.ArgumentParser()
parser.add_argument("--before", required=True, help="a git revision whose treespec/packed_linear.c is the baseline")
parser.add_argument("--rounds", type=int, default=12)
args = parser.parse_args()
torch.set_num_threads(2)
source = Path(native_linear.__file__).with_name("packed_linear.c")
folder = Path(tempfile.mkdtemp())
(folder / "before.c").write_text(subprocess.run(["git", "show", f"{args.before}:treespec/packed_linear.c"],
                                               capture_output=True, text=True, check=True).stdout)
(folder / "after.c").write_text(source.read_text())
kernels = {}
for name in ("before", "after"):
    subprocess.run(["gcc", *native_linear.FLAGS, str(folder / f"{name}.c"), "-o", str(folder / f"{name}.so")],
                   check=True)
    fn = ctypes.CDLL(str(folder / f"{name}.so")).packed_linear
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int], ctypes.c_int
    kernels[name] = fn

target, _ = reference.load("smollm2")
if not native_linear.packed_available():
    raise SystemExit("the packed kernel needs AVX-512")
steps = forward_steps(target, [1, 16], past_len=256)
cold = [native_linear.pack(torch.randn(1536, 576)) for _ in range(int(256e6 // (1536 * 576 * 4)))]
one = torch.randn(1, 576)


def stream_rate() -> float:
    native_linear._state["packed"] = kernels["before"]
    start = time.perf_counter()
    for weight in cold:
        native_linear.packed_linear(one, weight, 1536)
    return sum(w.numel() * 4 for w in cold) / (time.perf_counter() - start) / 1e9


rows = []
print(f"before = {args.before}, after = this checkout; ms per forward (median of 3)")
for _ in range(args.rounds):
    gbs = stream_rate()
    row = {"GB/s": gbs}
    for name, fn in kernels.items():
        native_linear._state["packed"] = fn
        for n in (1, 16):
            row[f"{name} T({n})"] = median_time(steps[n], repeats=3, warmup=1) * 1e3
    rows.append(row)
    print("  ".join(f"{k} {v:5.1f}" for k, v in row.items()), flush=True)
native_linear._state.pop("packed")
for state, keep in (("apart (>= 37 GB/s)", lambda r: r["GB/s"] >= 37),
                    ("together (< 37 GB/s)", lambda r: r["GB/s"] < 37)):
    chosen = [r for r in rows if keep(r)]
    if chosen:
        med = {k: statistics.median(r[k] for r in chosen) for k in chosen[0]}
        print(f"{state}, {len(chosen)} rounds: " + "  ".join(
            f"{name} T(1) {med[f'{name} T(1)']:.1f} T(16) {med[f'{name} T(16)']:.1f} "
            f"ratio {med[f'{name} T(16)'] / med[f'{name} T(1)']:.2f}" for name in kernels))

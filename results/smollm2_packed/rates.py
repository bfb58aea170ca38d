"""Why SmolLM2's T(16)/T(1) on the packed kernel moves between runs: samples, alternately for ``samples`` rounds,
the packed kernel's arithmetic rate (16 rows against a 1536 x 576 weight held in cache: GFLOP/s), its streaming rate
(one row against 512 MB of distinct weights, each read from memory: GB/s), and SmolLM2's one-forward cost after 256
cached tokens at 1 and 16 new tokens. A 16-token pass is bound by the arithmetic (4.3 GFLOP of linear layers), a
one-token pass by the read (540 MB); if the two rates move apart, so does the ratio.

    python results/smollm2_packed/rates.py [samples=12]
"""

import statistics
import sys
import time

import torch

from treespec import native_linear, reference
from treespec.timing import forward_steps, median_time

samples = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("samples", 12))
torch.set_num_threads(2)
warm_weight = native_linear.pack(torch.randn(1536, 576))
warm_x = torch.randn(16, 576)
cold = [native_linear.pack(torch.randn(1536, 576)) for _ in range(int(512e6 // (1536 * 576 * 4)))]
one = torch.randn(1, 576)
target, _ = reference.load("smollm2")
steps = forward_steps(target, [1, 16], past_len=256)


def compute_rate() -> float:
    calls = 200
    start = time.perf_counter()
    for _ in range(calls):
        native_linear.packed_linear(warm_x, warm_weight, 1536)
    return 2 * 16 * 1536 * 576 * calls / (time.perf_counter() - start) / 1e9


def stream_rate() -> float:
    start = time.perf_counter()
    for packed in cold:
        native_linear.packed_linear(one, packed, 1536)
    return sum(p.numel() * 4 for p in cold) / (time.perf_counter() - start) / 1e9


rows = []
for _ in range(samples):
    compute_rate(), stream_rate()  # warm-up of this round
    gflops, gbs = compute_rate(), stream_rate()
    t1, t16 = (median_time(steps[n], repeats=5, warmup=1) * 1e3 for n in (1, 16))
    rows.append((gflops, gbs, t1, t16))
    print(f"arithmetic {gflops:6.1f} GFLOP/s   stream {gbs:5.1f} GB/s   T(1) {t1:5.1f} ms   T(16) {t16:5.1f} ms   "
          f"T(16)/T(1) {t16 / t1:.2f}", flush=True)
columns = list(zip(*rows, strict=True))
print("medians: " + "  ".join(f"{name} {statistics.median(c):.2f}"
                              for name, c in zip(("GFLOP/s", "GB/s", "T1", "T16"), columns, strict=True)))
if len(rows) > 2:
    ratios = [r[3] / r[2] for r in rows]
    print(f"T(16)/T(1): median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
          f"correlation with the stream rate {statistics.correlation(columns[1], ratios):+.2f}, "
          f"with the arithmetic rate {statistics.correlation(columns[0], ratios):+.2f}")

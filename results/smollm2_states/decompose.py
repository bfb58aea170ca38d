"""SmolLM2's one-forward cost T(1) and T(16) after 256 cached tokens, split into its linear layers alone and the rest,
with this VM's arithmetic and memory rates, round by round: which part of a 16-token pass moves when the machine
changes state (results/smollm2_packed/README.md: two states, and T(16)/T(1) 1.3-1.4 in one, 1.7-2.1 in the other).

Per round: the packed kernel's arithmetic rate (16 rows on a cached 1536 x 576 weight) and streaming rate (one row
over 512 MB of weights); a replay of the pass's 211 linear products alone (SmolLM2's own packed weights in the
model's order, called straight through ctypes: no Python module, no attention) at 1 and 16 rows; and the model's
forward at 1 and 16 tokens. "rest" is the forward minus its replay: attention, norms, element-wise work and Python.

    python results/smollm2_states/decompose.py [rounds=8]
"""

import statistics
import sys
import time

import torch
from torch import nn

from treespec import native_linear, reference
from treespec.linear_kernels import packed_weight
from treespec.timing import forward_steps, median_time

rounds = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("rounds", 8))
torch.set_num_threads(2)
lib = native_linear.library()
target, _ = reference.load("smollm2")  # linear_kernel auto: packed here (refused below where it is not)
if not native_linear.packed_available():
    sys.exit("this script replays the packed kernel's products: it needs AVX-512")
steps = forward_steps(target, [1, 16], past_len=256)
packed = [(packed_weight(m), m.weight.shape[0], m.weight.shape[1]) for m in target.modules()
          if isinstance(m, nn.Linear)]
inputs = {n: {k: torch.randn(n, k) for k in {p[2] for p in packed}} for n in (1, 16)}
outputs = {n: {o: torch.empty(n, o) for o in {p[1] for p in packed}} for n in (1, 16)}
warm = native_linear.pack(torch.randn(1536, 576))
cold = [native_linear.pack(torch.randn(1536, 576)) for _ in range(int(512e6 // (1536 * 576 * 4)))]
warm_x, one = torch.randn(16, 576), torch.randn(1, 576)


def replay(n: int) -> None:
    for weight, out_features, in_features in packed:
        lib.packed_linear(inputs[n][in_features].data_ptr(), weight.data_ptr(), None,
                          outputs[n][out_features].data_ptr(), n, in_features, out_features, 2)


def arithmetic() -> float:
    start = time.perf_counter()
    for _ in range(200):
        native_linear.packed_linear(warm_x, warm, 1536)
    return 2 * 16 * 1536 * 576 * 200 / (time.perf_counter() - start) / 1e9


def stream() -> float:
    start = time.perf_counter()
    for weight in cold:
        native_linear.packed_linear(one, weight, 1536)
    return sum(w.numel() * 4 for w in cold) / (time.perf_counter() - start) / 1e9


print(f"{sum(p[0].numel() for p in packed) * 4 / 1e6:.0f} MB of packed weights in {len(packed)} products")
print("GFLOP/s  GB/s | linear alone T1 T16 | forward T1 T16 | rest T1 T16 | T16/T1")
rows = []
for _ in range(rounds):
    arithmetic(), stream()  # this round's warm-up
    gflops, gbs = arithmetic(), stream()
    lin = {n: median_time(lambda n=n: replay(n), repeats=5, warmup=1) * 1e3 for n in (1, 16)}
    fwd = {n: median_time(steps[n], repeats=5, warmup=1) * 1e3 for n in (1, 16)}
    row = (gflops, gbs, lin[1], lin[16], fwd[1], fwd[16], fwd[1] - lin[1], fwd[16] - lin[16], fwd[16] / fwd[1])
    rows.append(row)
    print("{:7.1f} {:5.1f} | {:5.1f} {:5.1f} | {:5.1f} {:5.1f} | {:5.1f} {:5.1f} | {:.2f}".format(*row), flush=True)
print("medians " + " ".join(f"{statistics.median(c):.2f}" for c in zip(*rows, strict=True)))

"""What fusing SmolLM2's gated MLPs on the packed kernel saves (``linear_kernels._gated_mlp_forward``: gate and up
products and the SiLU in one call): T(N) after 256 cached tokens with the fusion on and off (the MLP's own forward
on the same packed linear kernel), alternated round by round in one process, each round tagged by this VM's state
(the memory's streaming rate: >= 37 GB/s when its two CPUs sit on different core complexes,
results/smollm2_states/). Medians over the rounds of each state, ms.

    python results/gated_mlp/ab.py [rounds=16]
"""

import statistics
import sys

import torch

from treespec import linear_kernels, reference
from treespec.timing import forward_steps, median_time, memory_probe

rounds = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("rounds", 16))
torch.set_num_threads(2)
target, _ = reference.load("smollm2")
mlps = [m for m in target.modules() if linear_kernels.fusable_mlp(m)]
fused = {m: m.__dict__["forward"] for m in mlps}  # what the loader installed
sizes = [1, 2, 4, 8, 16]
steps = forward_steps(target, sizes, past_len=256)
stream_rate = memory_probe(256)


def use_fused(on: bool) -> None:
    for m in mlps:
        if on:
            m.forward = fused[m]
        else:
            m.__dict__.pop("forward", None)


rows = []
print(f"{len(mlps)} fused MLPs; ms per forward (median of 3)")
for _ in range(rounds):
    row = {"GB/s": stream_rate()}
    for on in (True, False):
        use_fused(on)
        for n in sizes:
            row[(on, n)] = median_time(steps[n], repeats=3, warmup=1) * 1e3
    rows.append(row)
    print(f"{row['GB/s']:4.1f} GB/s  fused " + " ".join(f"{row[(True, n)]:5.1f}" for n in sizes) + "   unfused "
          + " ".join(f"{row[(False, n)]:5.1f}" for n in sizes), flush=True)
use_fused(True)
for state, keep in (("apart (>= 37 GB/s)", lambda r: r["GB/s"] >= 37),
                    ("together (< 37 GB/s)", lambda r: r["GB/s"] < 37)):
    chosen = [r for r in rows if keep(r)]
    if not chosen:
        continue
    print(f"{state}, {len(chosen)} rounds:")
    for on in (True, False):
        med = {n: statistics.median(r[(on, n)] for r in chosen) for n in sizes}
        print(f"  {'fused  ' if on else 'unfused'} " + "  ".join(f"T({n}) {med[n]:.1f}" for n in sizes)
              + "   T(N)/T(1) " + " / ".join(f"{med[n] / med[1]:.2f}" for n in sizes[1:]))

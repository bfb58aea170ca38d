"""What the native few-query attention kernel (treespec/few_query_attention.c) saves SmolLM2-135M on this CPU: its
one-forward cost T(N) after 256 cached tokens, N = 1-16, with the kernel on and off (torch's flash kernel with
``enable_gqa``) alternated round by round, then one layer's attention call alone at each N. Medians over rounds.

    python results/few_query_attention/ab.py [rounds=6]
"""

import statistics
import sys
import time

import torch

from treespec import reference
from treespec.gqa_attention import sdpa_gqa_in_place, use_native_attention
from treespec.timing import forward_steps, median_time

rounds = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("rounds", 6))
torch.set_num_threads(2)
target, _ = reference.load("smollm2")
sizes = [1, 2, 4, 8, 16]
steps = forward_steps(target, sizes, past_len=256)
times = {on: {n: [] for n in sizes} for on in (True, False)}
for _ in range(rounds):
    for on in (True, False):
        use_native_attention(target, on)
        for n in sizes:
            times[on][n].append(median_time(steps[n], repeats=5, warmup=1) * 1e3)
print(f"SmolLM2-135M, 2 threads, one forward after 256 cached tokens, median of {rounds} rounds (ms)")
print("| attention | " + " | ".join(f"T({n})" for n in sizes) + " | " + " | ".join(f"T({n})/T(1)" for n in sizes[1:])
      + " |")
print("|---|" + "---|" * (2 * len(sizes) - 1))
medians = {on: {n: statistics.median(t) for n, t in by_n.items()} for on, by_n in times.items()}
for on, m in medians.items():
    print(f"| {'native' if on else 'torch flash'} | " + " | ".join(f"{m[n]:.1f}" for n in sizes) + " | "
          + " | ".join(f"{m[n] / m[1]:.2f}" for n in sizes[1:]) + " |")
print("native saves per pass (ms): " + "  ".join(f"N={n}: {medians[False][n] - medians[True][n]:+.2f}" for n in sizes))

config = target.config
heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
calls = {on: {} for on in (True, False)}
for n in sizes[1:]:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, n, heads, dim, generator=gen).transpose(1, 2)  # [1, h, n, d], as transformers makes it
    k, v = (torch.randn(1, kv, 512, dim, generator=gen)[:, :, :256 + n] for _ in range(2))  # a preallocated cache
    mask = torch.zeros(1, 1, n, 256 + n)
    for on in (True, False):
        layer = type("Layer", (), {"num_key_value_groups": heads // kv, "treespec_native_attention": on})()
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(200):
                sdpa_gqa_in_place(layer, q, k, v, mask, scaling=dim ** -0.5)
            samples.append((time.perf_counter() - start) / 200 * 1e6)
        calls[on][n] = statistics.median(samples)
print("one layer's attention call (µs), native / torch flash: "
      + "  ".join(f"N={n}: {calls[True][n]:.0f} / {calls[False][n]:.0f}" for n in sizes[1:]))

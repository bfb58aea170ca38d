"""Where a few-token pass spends its time on this CPU, by kernel: the linear layers' (treespec/linear_kernels.py)
and, for a grouped-query target, attention's (treespec/gqa_attention.py: torch's flash kernel reading the grouped
heads in place, and the native few-query kernel where it builds).

For each setting (torch's F.linear/MKL with transformers' sdpa: the stock model; oneDNN's linear; the few-row
kernel; the native kernel and, on AVX-512, the packed one where they build (treespec/native_linear.py); each with
treespec's in-place GQA attention on a grouped-query target: treespec's default on CPUs is the packed kernel, else the
native one, else the few-row one, with it): the target's cost curve T(N) (one forward over N new tokens after 256
cached ones) and T(N)/T(1); then the matrix products of its shapes alone per linear kernel (each weight read from
memory: enough distinct copies to overflow the caches). Settings alternate round by round, so a slow spell of a
shared machine falls on all; every number is a median over rounds.

    python scripts/cpu_kernels.py --model smollm2 --threads 2 --out results/linear_kernels/smollm2.json
    python scripts/cpu_kernels.py --model target            # the code reference
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from treespec import native_linear, reference
from treespec.gqa_attention import NAME as GQA_SDPA
from treespec.gqa_attention import native_available, use_native_attention
from treespec.linear_kernels import use_linear_kernel
from treespec.planning.autotree import measure_cost_curve

KERNELS = (*(["packed"] if native_linear.packed_available() else []),
           *(["native"] if native_linear.available() else []), "fewrow", "onednn", "torch")
# an attention setting: (attn_implementation, whether the native few-query kernel runs)
ATTENTION = {"sdpa": ("sdpa", False), f"{GQA_SDPA} flash": (GQA_SDPA, False),
             **({f"{GQA_SDPA} native": (GQA_SDPA, True)} if native_available() else {})}
# name: (linear kernel, attention setting)
SETTINGS = {f"{kernel} + {attention}": (kernel, attention) for attention in ATTENTION
            for kernel in ("torch", *KERNELS[:-1][::-1]) if attention == "sdpa" or kernel != "torch"}


def matmul_times(shape: tuple[int, int], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """{kernel: {N: median ms}} of [N, in] × weight [out, in]ᵀ, a different weight copy each call (64 MB of them)."""
    out_f, in_f = shape
    layers = [nn.Linear(in_f, out_f, bias=False) for _ in range(max(2, int(64e6 // (out_f * in_f * 4))))]
    times = {k: {n: [] for n in sizes} for k in KERNELS}
    inputs = {n: torch.randn(n, in_f) for n in sizes}
    with torch.no_grad():
        for round_ in range(repeats + 1):  # round 0 untimed (first-call set-up)
            for kernel in KERNELS:
                for layer in layers:
                    use_linear_kernel(layer, kernel)
                    layer(inputs[sizes[-1]])  # untimed: the few-row kernel reorders a weight on first use
                for n in sizes:
                    start = time.perf_counter()
                    for layer in layers:
                        layer(inputs[n])
                    if round_:
                        times[kernel][n].append((time.perf_counter() - start) / len(layers) * 1e3)
    return {k: {n: statistics.median(v) for n, v in by_n.items()} for k, by_n in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a reference model name (target, smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16,32")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the kernels (whole-model curves)")
    parser.add_argument("--repeats", type=int, default=5, help="forwards per size and round")
    parser.add_argument("--out", default=None, help="a JSON file for the numbers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(n) for n in args.sizes.split(",")]
    model, _ = reference.load(args.model, attn_implementation="sdpa")
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)})
    grouped = model.config.num_key_value_heads < model.config.num_attention_heads
    settings = {name: s for name, s in SETTINGS.items() if grouped or s[1] == "sdpa"}
    curves = {k: {n: [] for n in sizes} for k in settings}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, (kernel, attention) in settings.items():
                use_linear_kernel(model, kernel)
                model.set_attn_implementation(ATTENTION[attention][0])
                use_native_attention(model, ATTENTION[attention][1])
                for n, t in measure_cost_curve(model, sizes, past_len=256, repeats=args.repeats).items():
                    if n in curves[name]:  # not the sizes it adds beside a kernel's path change
                        curves[name][n].append(t * 1e3)
    curve = {k: {n: statistics.median(v) for n, v in by_n.items()} for k, by_n in curves.items()}
    print(f"{args.model}, {args.threads} threads: one forward after 256 cached tokens, median of {args.rounds} rounds")
    print("| linear + attention | T(1) ms | " + " | ".join(f"T({n})/T(1)" for n in sizes[1:]) + " |")
    print("|---|---|" + "---|" * (len(sizes) - 1))
    for k, c in curve.items():
        print(f"| {k} | {c[1]:.1f} | " + " | ".join(f"{c[n] / c[1]:.2f}" for n in sizes[1:]) + " |")
    stock = curve["torch + sdpa"]
    for k, c in curve.items():
        print(f"{k}: T(N) against the stock model's T(1): " + " ".join(f"{n}:{c[n] / stock[1]:.2f}" for n in sizes))
    products = {}
    for shape in shapes:
        products[f"{shape[0]}x{shape[1]}"] = t = matmul_times(shape, sizes, args.repeats * 4)
        print(f"  weight {shape[0]}x{shape[1]}: " + "; ".join(
            f"{k} {t[k][1]:.3f} ms, " + " ".join(f"{n}:{t[k][n] / t[k][1]:.2f}" for n in sizes[1:]) for k in KERNELS))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "threads": args.threads, "curve_ms": curve,
                                              "products_ms": products, "cpu_count": torch.get_num_threads()},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()

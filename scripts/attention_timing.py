"""Tree passes and decoding under each attention implementation: sdpa, flex_attention and cascade attention
(treespec/cascade.py: the prefix by flash-attn without a mask, the tree block in torch, merged by log-sum-exps).

    python scripts/attention_timing.py --device cuda --dtype bfloat16 --model reference --model llama3-8b
    python scripts/attention_timing.py --dry-run --out DIR      # CPU, toy sizes, the pure-torch stand-in kernel

Per model and implementation:
1. T(N)/T(1): the median time of one target pass over an N-node tree (the first N nodes of a 4-ary tree, its real
   tree mask, as generate builds it) after P cached tokens, over the one-token pass's time, for each P.
2. Decoding: treespec.planning.bench.measure, vanilla first and interleaved prompt by prompt: tokens/s, τ and the
   speedup over vanilla decoding under the same implementation; "× sdpa vanilla" divides by sdpa's vanilla tokens/s.
   The reference target decodes held-out code with its shipped EAGLE (a static and a dynamic tree); the
   random-weight 8B-shaped Llama has no drafter that knows it, so it runs prompt lookup on a prompt that repeats
   itself (its τ says how much that found).

flash-attn is optional: "treespec_cascade" runs only where it imports (and on CUDA); without it the cascade rows
use the pure-torch kernel ("treespec_cascade_torch") and say so. flex_attention runs on CUDA only (generate refuses
it on a CPU). Writes attention_timing.json and attention_timing.md under --out.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cost_curve import SHAPES  # this folder's shapes: Llama-3-8B's and a toy one
from treespec import Tree, reference
from treespec.attention_kernels import flash_available
from treespec.cache import TreeCache
from treespec.compat import cache_arg
from treespec.dynamic_tree import DynamicTree
from treespec.heads import PromptLookup, load
from treespec.planning.bench import Config, measure
from treespec.timing import median_time
from treespec.visibility import TreeAttention


def tree_of(n: int) -> Tree:
    """An n-node tree: the root and the first n − 1 nodes of a 4-ary tree (breadth first)."""
    return Tree.chain(0) if n == 1 else Tree(Tree.full(4, 4).paths[: n - 1])


@torch.no_grad()
def tree_pass_time(model, n: int, past_len: int, repeats: int) -> float:
    """Median seconds of one pass over an n-node tree after ``past_len`` cached tokens, with generate's masks."""
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    cache = TreeCache(model.config)
    model(input_ids=torch.randint(0, vocab, (1, past_len), generator=gen).to(model.device), **cache_arg(cache),
          use_cache=True)
    ids = torch.randint(0, vocab, (1, n), generator=gen).to(model.device)
    kwargs = TreeAttention(model, cache).shared(tree_of(n), past_len)

    def step():  # the pass's entries are dropped again: every call sees past_len cached tokens
        model(input_ids=ids, **cache_arg(cache), use_cache=True, **kwargs)
        cache.crop(-n)

    return median_time(step, repeats, warmup=3)


def build(name: str, device: str, dtype: torch.dtype):
    if name == "reference":
        return reference.load("target", dtype=dtype)[0].to(device).eval()
    with torch.device(device):  # allocated on the device: an 8B model in fp32 on the host would be 32 GB
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[name], attn_implementation="sdpa"))
    return model.to(dtype).eval()


def use(model, attn: str) -> None:
    """Switch ``model`` to ``attn`` (every layer reads config._attn_implementation at each forward)."""
    model.config._attn_implementation = attn


def decode_configs(name: str, model, args):
    """(configs, prompts [1, P] tensors, max_new_tokens) of a model's decoding measurement."""
    if name == "reference":
        eagle = load("reference:eagle", model)
        tokenizer = reference.load("target")[1]
        texts = reference.prompts()[: args.prompts]
        prompts = [tokenizer(t, return_tensors="pt").input_ids[:, -256:].to(model.device) for t in texts]
        return [Config("eagle, full 2×3", eagle, Tree.full(2, 3)),
                Config("eagle, dynamic 16/5/4", eagle, DynamicTree(16, 5, 4))], prompts
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (1, 32), generator=gen).repeat(1, 4).to(model.device)
               for _ in range(args.prompts)]
    return [Config("prompt lookup, chain 4", PromptLookup(), Tree.chain(4))], prompts


def run_model(name: str, attns: list[str], report: dict, args) -> None:
    model = build(name, args.device, getattr(torch, args.dtype))
    report[name] = {}
    sdpa_vanilla = None
    for attn in attns:
        use(model, attn)
        entry = report[name][attn] = {"ratios": {}, "decode": {}}
        for past in args.past:
            times = {n: tree_pass_time(model, n, past, args.repeats) for n in args.sizes}
            entry["ratios"][past] = {n: t / times[args.sizes[0]] for n, t in times.items()}
            entry.setdefault("seconds", {})[past] = times
            print(f"{name} {attn} P={past}: " + ", ".join(f"T({n})={1e3 * t:.2f} ms" for n, t in times.items()),
                  flush=True)
        configs, prompts = decode_configs(name, model, args)
        rows = measure(model, configs, prompts, max_new_tokens=args.new_tokens)
        sdpa_vanilla = rows[0].tokens_per_s if attn == "sdpa" else sdpa_vanilla
        for row in rows:
            entry["decode"][row.name] = {"tokens_per_s": row.tokens_per_s, "speedup": row.speedup, "tau": row.tau,
                                         "vs_sdpa_vanilla": row.tokens_per_s / sdpa_vanilla if sdpa_vanilla else None}
            print(f"{name} {attn} {row.name}: {row.tokens_per_s:.1f} tok/s, τ {row.tau:.2f}, "
                  f"{row.speedup:.2f}× its vanilla", flush=True)
    del model


def markdown(report: dict, notes: list[str], args) -> str:
    lines = [f"# Attention implementations: tree passes and decoding ({args.device}, {args.dtype})", ""]
    lines += [f"- {n}" for n in notes] + [""]
    for name, by_attn in report.items():
        lines += [f"## {name}", "", "| attention | P | " + " | ".join(f"T({n})/T(1)" for n in args.sizes) + " |",
                  "|---|---|" + "---|" * len(args.sizes)]
        for attn, entry in by_attn.items():
            for past, ratios in entry["ratios"].items():
                t1 = 1e3 * entry["seconds"][past][args.sizes[0]]
                lines.append(f"| {attn} (T(1) = {t1:.2f} ms) | {past} | "
                             + " | ".join(f"{ratios[n]:.2f}" for n in args.sizes) + " |")
        lines += ["", "| attention | decoding | tokens/s | τ | speedup vs its vanilla | × sdpa vanilla |",
                  "|---|---|---|---|---|---|"]
        for attn, entry in by_attn.items():
            for config, d in entry["decode"].items():
                vs = f"{d['vs_sdpa_vanilla']:.2f}" if d["vs_sdpa_vanilla"] else "—"
                lines.append(f"| {attn} | {config} | {d['tokens_per_s']:.1f} | {d['tau']:.2f} | {d['speedup']:.2f}× "
                             f"| {vs} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", action="append", choices=["reference", *SHAPES], help="repeatable")
    parser.add_argument("--attn", nargs="+", default=None, help="default: sdpa, flex_attention (CUDA) and cascade")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--past", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="CPU, float32, toy sizes, the pure-torch kernel")
    parser.add_argument("--out", type=Path, default=Path("runs/attention_timing"))
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.dtype, args.sizes, args.past, args.repeats = "cpu", "float32", [1, 4, 16], [32], 2
        args.prompts, args.new_tokens, args.model = 2, 12, args.model or ["tiny", "reference"]
    cuda, flash = args.device.startswith("cuda"), flash_available()
    notes, attns = [], args.attn
    if attns is None:
        attns = ["sdpa"] + (["flex_attention"] if cuda else []) + \
            (["treespec_cascade"] if cuda and flash else ["treespec_cascade_torch"])
        if not (cuda and flash):
            notes.append(f"flash-attn {'is not installed' if not flash else 'needs CUDA'}: cascade attention ran with "
                         "the pure-torch kernel (treespec_cascade_torch), which materialises the prefix's scores; "
                         "its times are not flash-attn's")
    if not cuda:
        notes.append("flex_attention not run: it runs on CUDA only here")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    for name in args.model or ["reference", "llama3-8b"]:
        run_model(name, attns, report, args)
    meta = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "notes": notes,
            "gpu": torch.cuda.get_device_name() if cuda else None, "results": report}
    (args.out / "attention_timing.json").write_text(json.dumps(meta, indent=1))
    (args.out / "attention_timing.md").write_text(markdown(report, notes, args))
    print(markdown(report, notes, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

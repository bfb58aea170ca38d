"""Compiled static passes against eager ones (generate's ``compile=True``: treespec/static_pass.py) on the shipped
reference models: tokens/s per configuration, eager and compiled interleaved on the same prompts (each repeat
alternates which goes first), medians over prompts × repeats. Every shape is compiled in a warm-up first, so the
timed runs compile nothing. Timings mean something only on an otherwise idle machine.

    python scripts/compile_timing.py                         # inductor (the CPU's compile=True), 4 prompts × 3
    python scripts/compile_timing.py --prompts 8 --repeats 5 --max-new-tokens 96
"""

import argparse
import statistics
import time

import torch

from treespec import Tree, generate, reference
from treespec.heads import DraftModel, registry


def cases(target, draft):
    return [("vanilla", lambda: {}),
            ("draft model, chain 3", lambda: {"drafter": DraftModel(draft), "tree": Tree.chain(3)}),
            ("EAGLE, chain 4", lambda: {"drafter": registry.build("eagle", target, "reference:eagle"),
                                        "tree": Tree.chain(4)}),
            ("EAGLE, full 2×2", lambda: {"drafter": registry.build("eagle", target, "reference:eagle"),
                                         "tree": Tree.full(2, 2)})]


def tokens_per_s(target, ids, max_new_tokens: int, compile_with, make) -> tuple[float, torch.Tensor]:
    kwargs = make()  # a fresh drafter, made before the clock starts
    start = time.perf_counter()
    out = generate(target, ids, max_new_tokens=max_new_tokens, compile=compile_with, **kwargs)
    return (out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - start), out.sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--backend", default=None, help="a torch.compile backend instead of compile=True's")
    args = parser.parse_args()
    compile_with = True if args.backend is None else {"backend": args.backend}
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    prompts = [tokenizer(p, return_tensors="pt").input_ids[:, -192:] for p in reference.prompts()[: args.prompts]]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compile={compile_with!r}, "
          f"{args.prompts} prompts × {args.repeats} repeats × {args.max_new_tokens} new tokens\n")
    print("| configuration | eager tok/s (median) | compiled tok/s (median) | compiled / eager (median of pairs) | "
          "warm-up s |\n|---|---|---|---|---|")
    for label, make in cases(target, draft):
        start = time.perf_counter()
        for ids in prompts:  # compiles every shape these prompts reach (their truncated last steps included)
            _, compiled = tokens_per_s(target, ids, args.max_new_tokens, compile_with, make)
            _, eager = tokens_per_s(target, ids, args.max_new_tokens, False, make)
            if not torch.equal(compiled, eager):
                raise SystemExit(f"{label}: compiled output differs from eager")
        warm_up = time.perf_counter() - start
        times = {False: [], True: []}
        ratios = []
        for r in range(args.repeats):
            for ids in prompts:
                pair = {}
                for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                    pair[compiled] = tokens_per_s(target, ids, args.max_new_tokens,
                                                  compile_with if compiled else False, make)[0]
                    times[compiled].append(pair[compiled])
                ratios.append(pair[True] / pair[False])
        print(f"| {label} | {statistics.median(times[False]):.1f} | {statistics.median(times[True]):.1f} | "
              f"{statistics.median(ratios):.2f}× | {warm_up:.0f} |", flush=True)


if __name__ == "__main__":
    main()

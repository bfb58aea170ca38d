"""Predicted against measured τ of each lossless rule on sampled chains (treespec/planning/chain_tau.py,
docs/sampling.md "Predicting each rule's τ"): the shipped reference target and a shipped drafter sampling its candidates
at T = 1.

Predicted: the closed form per draft, averaged over one D-deep sampled chain per context, the contexts cut from
the target's own sampled continuations of the first half of the held-out prompts. Measured: mean tokens per
target pass of generate() on the other half, per rule and γ. τ is a count, not a speed: a busy machine does not
bias it.

    python scripts/chain_tau_check.py                 # EAGLE, γ = 2, 4, 6, rejection and block
    python scripts/chain_tau_check.py --drafter draft --new-tokens 64
"""

import argparse
import math
import statistics
import time

import torch

from treespec import generate, reference
from treespec.heads import registry
from treespec.planning.chain_tau import measure_chain_tau
from treespec.sampling import Sampling
from treespec.train.training.data import own_continuations
from treespec.tree import Tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="eagle", help="a shipped drafter that samples: eagle, eagle3, draft")
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens generated per measured prompt")
    parser.add_argument("--context", type=int, default=48, help="prompt tokens before each continuation")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    target, tokenizer = reference.load("target")
    module = registry.load_module(args.drafter, target, f"reference:{args.drafter}")
    drafter = registry.make(args.drafter, module, "sample")
    sampling = Sampling(1.0)
    ids = [tokenizer(text, return_tensors="pt").input_ids[:, : args.context] for text in reference.prompts()]
    ids = [x for x in ids if x.shape[1] == args.context]
    half = len(ids) // 2
    windows = own_continuations(target, torch.cat(ids[:half]), context=args.context, new_tokens=64, lead=16,
                                temperature=1.0, seed=0)
    predicted = measure_chain_tau(target, drafter, windows, depth=max(args.gammas), sampling=sampling, lead=16,
                                  cuts=8, generator=torch.Generator().manual_seed(0))
    print(f"{args.drafter}, candidates=sample, T=1: predicted from {predicted.drafts} drafts on {half} prompts' own "
          f"continuations; measured on {len(ids) - half} other prompts, {args.new_tokens} new tokens each")
    print("| γ | rule | predicted τ | measured τ | passes |")
    print("|---|---|---|---|---|")
    for gamma in args.gammas:
        for rule in ("rejection", "block"):
            lengths = []
            for k, prompt in enumerate(ids[half:]):
                out = generate(target, prompt, drafter=drafter, tree=Tree.chain(gamma), max_new_tokens=args.new_tokens,
                               temperature=1.0, acceptance=rule, generator=torch.Generator().manual_seed(k))
                lengths += out.accept_lengths
            err = statistics.stdev(lengths) / math.sqrt(len(lengths))
            print(f"| {gamma} | {rule} | {predicted.tau[rule][gamma]:.2f} ± {predicted.stderr[rule][gamma]:.2f} | "
                  f"{statistics.mean(lengths):.2f} ± {err:.2f} | {len(lengths)} |")
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

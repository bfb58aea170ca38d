"""Decode held-out code with the shipped reference models: vanilla vs speculation, measured in one run.

    python scripts/demo.py                       # greedy, 6 prompts, 96 new tokens each
    python scripts/demo.py --temperature 1.0     # lossless sampling
    python scripts/demo.py --auto                # also tree=auto with the shipped EAGLE: which tree it chose
"""

import argparse

import torch

from treespec import Tree, generate, reference
from treespec.heads import DraftModel, PromptLookup, load, load_profile
from treespec.planning.bench import Config, markdown_table, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts to decode")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4, help="chain length for draft-model speculation")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--auto", action="store_true", help="also decode with the shipped EAGLE and tree=auto (its "
                        "cost curve is measured on this machine once, then cached) and print the tree it chose")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    texts = reference.prompts()[: args.prompts]
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    configs = [
        Config(f"draft chain γ={args.gamma}", DraftModel(draft), Tree.chain(args.gamma)),
        Config("draft tree full(2,3)", DraftModel(draft), Tree.full(2, 3)),
        Config("prompt lookup chain γ=4", PromptLookup(), Tree.chain(4)),
    ]
    print(f"target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M; {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {torch.get_num_threads()} threads")
    rows = measure(target, configs, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_p=args.top_p, eos_token_id=None,
                   progress=lambda name, i: print(f"  prompt {i + 1}/{len(prompts)}: {name}", flush=True))
    print()
    print(markdown_table(rows))
    sample = configs[0]
    out = generate(target, prompts[0], drafter=sample.drafter, tree=sample.tree, max_new_tokens=48,
                   temperature=args.temperature, top_p=args.top_p)
    print("\nprompt tail + continuation (speculative):\n" + "-" * 60)
    print(tokenizer.decode(out.sequences[0, -48 - 32 :]))
    if args.auto:
        out = generate(target, prompts[0], drafter=load("reference:eagle", target), tree={"kind": "auto"},
                       profile=load_profile("reference:eagle", target), max_new_tokens=48,
                       temperature=args.temperature, top_p=args.top_p)
        print(f"\ntree=auto with the shipped EAGLE chose {out.tree!r} (τ {out.mean_accept_length:.2f})")


if __name__ == "__main__":
    main()

"""Quick A/B runs behind the closing note's "tried and dropped": configurations of prompt lookup with DFlash as its
fallback, timed interleaved prompt by prompt in one process on the 24 held-out code prompts × 64 tokens (the last
240 prompt tokens), greedy, 2 threads. Prints, per configuration, τ, ms a token (prefill included) and the median
over prompts of its tokens/s ÷ the first configuration's (each prompt's median over the repeats). From the
repository root:

    python results/dflash_fallback_ngram_2026-12-05/ab.py SET [repeats]

SET: ngram (prompt lookup's n-gram sizes in the pairing), fr (an FR-Spec head for the fallback's DFlash), chain (the
step's chain length), agreement (one-token matches kept only when earlier occurrences agree), miss (the block in
$BLOCK, trained where prompt lookup misses, beside the shipped one: DDTree 7 or a chain for the block, an FR-Spec head,
the step's chain 7 or 10).
"""

import json
import os
import statistics
import sys
import time

import torch

from treespec import Tree, generate, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, PromptLookup, registry
from treespec.heads.drafting.vocab import DraftVocab
from treespec.train.training.data import STDLIB_CORPUS, prepare_tokens

C7 = Tree.chain(7)


class AgreedPromptLookup(PromptLookup):
    """Prompt lookup whose one-token matches count only when at least ``k`` earlier occurrences continue alike."""

    def __init__(self, k: int = 2, **options):
        super().__init__(**options)
        self.k = k

    def _continuations(self, seq, windows, context, k):
        if 1 in windows and len(context) >= 1:
            hits = torch.nonzero((windows[1] == torch.tensor(context[-1:])).all(-1)).flatten()
            following = {int(seq[j + 1]) for j in hits.tolist()}
            if len(hits) < self.k or len(following) != 1:
                windows = {n: w for n, w in windows.items() if n != 1}  # longer matches only
        return super()._continuations(seq, windows, context, k)


def lookup(low: int, high: int, kind=PromptLookup, **options):
    return lambda: kind(min_ngram=low, max_ngram=high, **options)


def frequent(tokenizer, n: int) -> DraftVocab:
    """The n most frequent tokens of the stdlib corpus (drafter.draft_vocab=n's vocabulary)."""
    _, tokens, _ = prepare_tokens(STDLIB_CORPUS, len(tokenizer), ".cache/data", tokenizer=tokenizer)
    return DraftVocab.most_frequent(torch.bincount(tokens.long(), minlength=len(tokenizer)), n)


def configurations(name: str, target, tokenizer) -> dict:
    dflash = registry.build("dflash", target, source="reference:dflash")

    def pairing(first, block=dflash, part=None):
        part = DynamicTree(7, 7, 4) if part is None else part
        return lambda: Combined([first(), block], mode="fallback", part_trees=[None, part])

    if name == "ngram":
        return {"pl 1-3": (lookup(1, 3), C7), "pl 1-4": (lookup(1, 4), C7), "fb 1-3": (pairing(lookup(1, 3)), C7),
                "fb 2-3": (pairing(lookup(2, 3)), C7), "fb 2-4": (pairing(lookup(2, 4)), C7),
                "fb 2-5": (pairing(lookup(2, 5)), C7), "fb 3-4": (pairing(lookup(3, 4)), C7)}
    if name == "fr":
        module = registry.load_module("dflash", target, "reference:dflash")
        reduced = {n: registry.make("dflash", module, "topk", frequent(tokenizer, n)) for n in (2048, 1024)}
        return {"pl 1-4": (lookup(1, 4), C7), "fb 2-4": (pairing(lookup(2, 4)), C7),
                **{f"fb 2-4, FR {n}": (pairing(lookup(2, 4), d), C7) for n, d in reduced.items()}}
    if name == "chain":
        return {"pl 1-4": (lookup(1, 4), C7), "pl 1-4, chain 10": (lookup(1, 4), Tree.chain(10)),
                "fb 2-4": (pairing(lookup(2, 4)), C7), "fb 2-4, chain 10": (pairing(lookup(2, 4)), Tree.chain(10)),
                "fb 2-4, chain 12": (pairing(lookup(2, 4)), Tree.chain(12))}
    if name == "agreement":
        return {"pl 1-4": (lookup(1, 4), C7), "fb 2-4": (pairing(lookup(2, 4)), C7),
                **{f"fb 1-4, {k} agree": (pairing(lookup(1, 4, AgreedPromptLookup, k=k)), C7) for k in (2, 3)}}
    if name == "miss":
        module = registry.load_module("dflash", target, os.environ["BLOCK"])
        fr = frequent(tokenizer, 2048)
        miss, miss_fr = (registry.make("dflash", module, "topk", v) for v in (None, fr))
        shipped_fr = registry.make("dflash", registry.load_module("dflash", target, "reference:dflash"), "topk", fr)
        pl = lookup(2, 4)
        return {"pl 1-4": (lookup(1, 4), C7), "fb 2-4": (pairing(pl), C7), "fb 2-4, FR": (pairing(pl, shipped_fr), C7),
                "fb 2-4, block chain": (pairing(pl, dflash, Tree.chain(7)), C7),
                "miss": (pairing(pl, miss), C7), "miss, FR": (pairing(pl, miss_fr), C7),
                "miss, FR, chain 10": (pairing(pl, miss_fr), Tree.chain(10))}
    raise SystemExit(f"unknown set {name!r}: ngram, fr, chain, agreement or miss")


def main(name: str, repeats: int) -> None:
    torch.set_num_threads(2)
    target, tokenizer = reference.load("target")
    with open("treespec/models/prompts.jsonl") as f:
        rows = [row for row in map(json.loads, f) if row["split"] == "test"][:24]
    prompts = [tokenizer(row["text"], return_tensors="pt").input_ids[:, -240:] for row in rows]
    configs = configurations(name, target, tokenizer)
    speed = {c: [[] for _ in prompts] for c in configs}
    tokens, passes, seconds = dict.fromkeys(configs, 0), dict.fromkeys(configs, 0), dict.fromkeys(configs, 0.0)
    for _ in range(repeats):
        for i, ids in enumerate(prompts):
            for c, (make, tree) in configs.items():
                start = time.perf_counter()
                out = generate(target, ids, drafter=make(), tree=tree, max_new_tokens=64)
                elapsed, new = time.perf_counter() - start, out.sequences.shape[1] - ids.shape[1]
                speed[c][i].append(new / elapsed)
                tokens[c], passes[c], seconds[c] = tokens[c] + new, passes[c] + len(out.accept_lengths), \
                    seconds[c] + elapsed
    first = next(iter(configs))
    for c in configs:
        ratios = [statistics.median(s) / statistics.median(b) for s, b in zip(speed[c], speed[first], strict=True)]
        print(f"{c:20s} τ {tokens[c] / passes[c]:.2f}  ms a token {1e3 * seconds[c] / tokens[c]:.3f}  "
              f"median ratio to {first} {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)

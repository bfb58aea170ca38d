"""Prompt lookup with DFlash as its fallback, step by step: which part proposed each step, what it committed, and
what DFlash's proposal costs in the loop (the whole call and its parts, median ms), for prompt lookup's default
n-grams (3 down to 1) and for 4 down to 2. 24 held-out code prompts × 64 tokens, greedy, 2 threads, the last 240
prompt tokens. From the repository root:

    python results/dflash_fallback_ngram_2026-12-05/ask_split.py

BLOCK=<a DFlash folder> asks that block instead of ``reference:dflash``.
"""

import json
import os
import statistics
import time
from collections import defaultdict

import torch

import treespec.heads.dflash.drafter as dflash_drafter
from treespec import Tree, generate, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, PromptLookup, registry


def timed(store: dict, key: str, fn):
    def call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        store[key].append(time.perf_counter() - start)
        return out
    return call


def recording(propose, asked: list, who: list):
    """``propose`` that appends who proposed each step to ``who`` (DFlash when it was asked: ``asked`` not empty)."""
    def call(*args, **kwargs):
        asked.clear()
        proposals = propose(*args, **kwargs)
        who.append("dflash" if asked else ("prompt lookup" if len(proposals.trees[0]) else "none"))
        return proposals
    return call


def main() -> None:
    torch.set_num_threads(2)
    target, tokenizer = reference.load("target")
    with open("treespec/models/prompts.jsonl") as f:
        rows = [row for row in map(json.loads, f) if row["split"] == "test"][:24]
    prompts = [tokenizer(row["text"], return_tensors="pt").input_ids[:, -240:] for row in rows]
    dflash = registry.build("dflash", target, source=os.environ.get("BLOCK", "reference:dflash"))
    costs = defaultdict(list)
    for name in ("_add_held", "_block", "_head"):
        setattr(dflash, name, timed(costs, name, getattr(dflash, name)))
    dflash_drafter.block_proposals = timed(costs, "block_proposals", dflash_drafter.block_proposals)
    asked = []
    propose = timed(costs, "propose", dflash.propose)
    dflash.propose = lambda *a, **k: (asked.append(True), propose(*a, **k))[1]
    for low, high in ((1, 3), (2, 4)):
        steps, costs_before = defaultdict(list), {k: len(v) for k, v in costs.items()}
        for ids in prompts:
            pairing = Combined([PromptLookup(min_ngram=low, max_ngram=high), dflash], mode="fallback",
                               part_trees=[None, DynamicTree(7, 7, 4)])
            who = []
            pairing.propose = recording(pairing.propose, asked, who)
            out = generate(target, ids, drafter=pairing, tree=Tree.chain(7), max_new_tokens=64)
            # a row's last step or two can run without the drafter (no room left for a tree): not counted
            for part, accepted in zip(who, out.accept_lengths, strict=False):
                steps[part].append(accepted)
        print(f"n-grams {high} down to {low}: " + "; ".join(
            f"{part} {len(v)} steps, τ {statistics.mean(v):.2f}" for part, v in sorted(steps.items())))
        print("  DFlash in the loop, median ms: " + ", ".join(
            f"{k.strip('_')} {1e3 * statistics.median(v[costs_before.get(k, 0):]):.2f}" for k, v in costs.items()))


if __name__ == "__main__":
    main()

"""One-off screen behind docs/results.md's "a floor on a DDTree node's path probability" (idle, 2 threads):
prompt lookup with DFlash as its fallback on DDTree 7, with DDTree's nodes filtered by a floor on their path
probability (monkeypatched), against prompt lookup alone; 12 held-out prompts (every other one), their last 240
tokens, 64 new tokens, three repeats. From the repository root:
    python results/dflash_part_trees_2026-12-05/probability_floor.py"""
import math
import statistics as st
import time

import torch

import treespec.block_tree as bt
from treespec import Tree, generate, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, PromptLookup, registry

torch.set_num_threads(2)
target, tokenizer = reference.load("target")
texts = reference.prompts()
unfiltered, floor = bt.best_paths, [0.0]


def filtered(log_probs, budget):
    kept = unfiltered(log_probs, budget)
    if floor[0] <= 0:
        return kept
    return [p for p in kept if sum(log_probs[i][r] for i, r in enumerate(p)) >= math.log(floor[0])]


bt.best_paths = filtered
lookup = PromptLookup()
fallback = Combined([PromptLookup(), registry.build("dflash", target, "reference:dflash")], mode="fallback",
                    part_trees=[None, DynamicTree(7, 7, 4)])
floors = [0.0, 0.05, 0.1, 0.2, 0.3]
ratio, tau = {f: [] for f in floors}, {f: [] for f in floors}
for i in range(0, 24, 2):
    ids = tokenizer(texts[i], return_tensors="pt").input_ids[:, -240:]
    for repeat in range(3):
        t0 = time.perf_counter()
        generate(target, ids, drafter=lookup, tree=Tree.chain(7), max_new_tokens=64)
        alone = time.perf_counter() - t0
        for f in floors:
            floor[0] = f
            t0 = time.perf_counter()
            out = generate(target, ids, drafter=fallback, tree=Tree.chain(7), max_new_tokens=64)
            ratio[f].append(alone / (time.perf_counter() - t0))
            if repeat == 0:
                tau[f].append(out.mean_accept_length)
print("median speed ratio to prompt lookup", {f: round(st.median(v), 3) for f, v in ratio.items()})
print("mean tau", {f: round(sum(v) / len(v), 2) for f, v in tau.items()})

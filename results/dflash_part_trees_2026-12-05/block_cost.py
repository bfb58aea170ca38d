"""One-off timing behind docs/results.md's DFlash block cost on this CPU (idle, 2 threads): reference:dflash's
``propose`` on a chain of 7 and on DDTree 7, its layer pass and its head alone, after 250 cached context entries;
median of 50. Run from the repository root: python results/dflash_part_trees_2026-12-05/block_cost.py"""
import statistics as st
import time
from types import SimpleNamespace

import torch

from treespec import Tree, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import registry
from treespec.sampling import GREEDY

torch.set_num_threads(2)
target, _ = reference.load("target")
dflash = registry.build("dflash", target, "reference:dflash")
dflash.reset()
dflash._add(torch.randn(1, 250, dflash.model.fc.in_features), [250])
committed = SimpleNamespace(lengths=[251], tokens=torch.zeros(1, 251, dtype=torch.long))
roots = torch.zeros(1, dtype=torch.long)


def median_ms(call, n=50):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return round(st.median(times) * 1e3, 3)


with torch.no_grad():
    block = dflash._block(roots)
    for tree in (Tree.chain(7), DynamicTree(7, 7, 4)):
        print(tree, "propose ms", median_ms(lambda t=tree: dflash.propose(committed, None, t, GREEDY)))
    print("layer pass ms", median_ms(lambda: dflash._block(roots)))
    print("head ms", median_ms(lambda: dflash._head(block[:, 1:8])))

"""Each block's validation metrics (training's ``val/dflash_*``: held-out stdlib windows, teacher forced) with blocks
anchored everywhere and only where prompt lookup's 2-grams miss (``anchors_at``), for the shipped blocks
(``reference:dflash``: every position of greedy continuations; ``reference:dflash_fallback``: its misses). From the
repository root:

    python results/dflash_lookup_miss_2026-12-06/val_where.py
"""

from pathlib import Path

import torch

from treespec import reference
from treespec.heads import registry
from treespec.heads.dflash.objective import dflash_metrics
from treespec.train.training.data import held_out_windows

KEYS = ("tau", "top1_1", "top1_2", "top1_3", "top1_4", "anchors")


def main() -> None:
    torch.set_num_threads(2)
    target, tokenizer = reference.load("target")
    windows = held_out_windows(tokenizer, 256, 32, Path(".cache") / "data")  # ship_drafter.py's windows
    for source in ("reference:dflash", "reference:dflash_fallback"):
        block = registry.load_module("dflash", target, source)
        for where in ("all", "lookup_miss"):
            metrics = dflash_metrics(target, block, windows, anchors=64, anchors_at=where, lookup_min_ngram=2)
            print(f"{source:26s} anchors {where:12s} " + "  ".join(f"{k} {metrics[k]:.3f}" for k in KEYS))


if __name__ == "__main__":
    main()

"""What asking the target for features costs in the loop: prompt lookup alone against prompt lookup that asks for
three layers' features (as DFlash's do, in a fallback pairing) and ignores them, on 12 held-out prompts × 3 repeats,
interleaved, 2 threads. Prints the median ratio of tokens/s. Run from the repository root:

    python results/dflash_variants_2026-12-05/feature_overhead.py
"""

import json
import statistics
import time

import torch

from treespec import Tree, generate, reference
from treespec.heads.prompt_lookup.drafter import PromptLookup


class FeaturePromptLookup(PromptLookup):
    """Prompt lookup whose target passes return DFlash's three feature layers (3, 5, 7), unused."""

    needs_features = True
    feature_layers = (3, 5, 7)

    def prefill(self, input_ids, features, attention_mask=None):
        return super().prefill(input_ids, None, attention_mask)

    def accept(self, paths, features):
        return super().accept(paths, None)


def main() -> None:
    torch.set_num_threads(2)
    target, tokenizer = reference.load("target")
    with open("treespec/models/prompts.jsonl") as f:
        rows = [json.loads(line) for line in f if json.loads(line)["split"] == "test"][:12]
    prompts = [tokenizer(row["text"], return_tensors="pt").input_ids[:, -240:] for row in rows]
    tokens_per_s = {"plain": [], "features": []}
    for _ in range(3):
        for ids in prompts:
            for name, drafter in (("plain", PromptLookup()), ("features", FeaturePromptLookup())):
                start = time.perf_counter()
                out = generate(target, ids, drafter=drafter, tree=Tree.chain(7), max_new_tokens=64)
                tokens_per_s[name].append((out.sequences.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    ratios = [b / a for a, b in zip(tokens_per_s["plain"], tokens_per_s["features"], strict=True)]
    print(f"features / plain tokens/s: median {statistics.median(ratios):.3f}, quartiles "
          f"{statistics.quantiles(ratios, n=4)}")


if __name__ == "__main__":
    main()

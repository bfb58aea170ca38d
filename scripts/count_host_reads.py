"""Host reads per decoding step on the shipped reference models, per drafter and tree (treespec/host_reads.py:
what counts as a read; docs/design.md, "Host reads per step": the table this prints).

    python scripts/count_host_reads.py                  # greedy and sampled, 48 new tokens
    python scripts/count_host_reads.py --sites          # and where each case's device reads come from
"""

import argparse

import torch

from treespec import Tree, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, PromptLookup, registry
from treespec.host_reads import reads_per_step


def cases(target, draft):
    eagle, eagle3, medusa, hydra = (registry.build(k, target, f"reference:{k}")
                                    for k in ("eagle", "eagle3", "medusa", "hydra"))
    sampled_hydra = registry.build("hydra", target, "reference:hydra", candidates="sample")
    sampled_draft = DraftModel(draft, candidates="sample")
    return [
        ("vanilla", None, None), ("draft model", DraftModel(draft), Tree.chain(3)),
        ("draft model", DraftModel(draft), Tree.full(2, 3)), ("draft model", DraftModel(draft), DynamicTree(16, 5, 4)),
        ("draft model, sampled candidates", sampled_draft, Tree.chain(3)),
        ("draft model, sampled candidates", sampled_draft, Tree.full(2, 2)),
        ("EAGLE", eagle, Tree.chain(4)), ("EAGLE", eagle, Tree.full(2, 3)), ("EAGLE", eagle, DynamicTree(16, 5, 4)),
        ("EAGLE-3", eagle3, Tree.chain(4)), ("EAGLE-3", eagle3, DynamicTree(16, 5, 4)),
        ("Medusa", medusa, Tree.chain(3)), ("Medusa", medusa, Tree.full(2, 2)),
        ("Hydra", hydra, Tree.chain(3)), ("Hydra", hydra, Tree.full(2, 3)),
        ("Hydra, sampled candidates", sampled_hydra, Tree.full(2, 2)),
        ("prompt lookup", PromptLookup(), Tree.chain(4)), ("prompt lookup", PromptLookup(), Tree.full(2, 2)),
    ]


def name(tree) -> str:
    if tree is None:
        return "-"
    if isinstance(tree, DynamicTree):
        return f"dynamic {tree.total_tokens}/{tree.depth}/{tree.top_k}"
    return f"chain {tree.depth}" if tree.is_chain else f"full {len(tree.children[0])}×{tree.depth}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sites", action="store_true", help="print where each case's device reads come from")
    args = parser.parse_args()
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    ids = tokenizer(reference.prompts()[0], return_tensors="pt").input_ids[:, -256:]
    print("| drafter | tree | greedy: device reads / step | all reads | sampled (T = 1): device reads / step | "
          "all reads |\n|---|---|---|---|---|---|")
    for label, drafter, tree in cases(target, draft):
        row, sites = [], []
        for temperature in (0.0, 1.0):
            counts = reads_per_step(target, ids, drafter=drafter, tree=tree, max_new_tokens=args.max_new_tokens,
                                    temperature=temperature, generator=torch.Generator().manual_seed(0))
            row += [f"{counts['device']:.1f}", f"{counts['all']:.1f}"]
            sites.append(counts["sites"])
        print(f"| {label} | {name(tree)} | " + " | ".join(row) + " |", flush=True)
        if args.sites:
            for temperature, found in zip((0, 1), sites, strict=True):
                print(f"    T={temperature}: " + ", ".join(f"{s} {f}×{n}" for (s, f), n in found.most_common()))


if __name__ == "__main__":
    main()

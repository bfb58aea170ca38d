"""Per-depth acceptance curves of one or more comparison runs, drafters side by side on the same trees
(train/compare/depth_curves.py): a figure and a markdown table.

    python scripts/acceptance_by_depth.py runs/compare/<run> [more runs] --out results/eagle3_vs_eagle_depth
    python scripts/acceptance_by_depth.py runs/compare/<run> --trees "chain γ=6" "accuracy 16"
"""

import argparse
from pathlib import Path

from treespec.train.compare import depth_curves


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", type=Path, help="comparison run folders (each with results.json)")
    parser.add_argument("--trees", nargs="*", default=None, help="tree labels (default: every shared tree)")
    parser.add_argument("--out", type=Path, default=None, help="PNG and .md path prefix (default: the first run's "
                                                                "acceptance_by_depth)")
    parser.add_argument("--title", default="Acceptance by draft depth, drafters side by side")
    args = parser.parse_args()
    by_tree = depth_curves.curves([depth_curves.load(r) for r in args.runs], args.trees)
    if not by_tree:
        raise SystemExit("no tree is shared by two configurations of these runs (or none of --trees was measured)")
    out = args.out or args.runs[0] / "acceptance_by_depth"
    out.parent.mkdir(parents=True, exist_ok=True)
    depth_curves.plot(by_tree, out.with_suffix(".png"), args.title)
    text = depth_curves.table(by_tree)
    out.with_suffix(".md").write_text(f"# {args.title}\n\nRuns: {', '.join(str(r) for r in args.runs)}\n\n{text}")
    print(text)
    print(f"written: {out.with_suffix('.png')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()

"""A drafter's data-scaling curve: one recipe trained at several data sizes, read back into a table, a plot and a
fit extrapolated to a target τ.

Each point is a finished ``scripts/train_heads.py`` run (its ``summary.json``: trained tokens, held-out top-1 per
depth, the end-of-run τ), optionally with comparison runs (``scripts/compare_trees.py``'s ``summary.csv``) that timed
every point's drafter under the point's name, e.g. on held-out conversations and on Spec-Bench:

    python scripts/scaling_curve.py --run 122k=runs/heads/scale-122k --run 350k=runs/heads/scale-350k \
        --compare held-out=runs/compare/scale-heldout --compare spec-bench=runs/compare/scale-specbench \
        --goal 3.5 --out results/scaling_smollm2

A point may also be given as a run's ``summary.json`` itself (``--run 122k=results/curve/summary_122k.json``: a
run folder does not outlive its machine, its summary can be kept), and one comparison label may name several
folders (``--compare held-out=A --compare held-out=B``): each point is read from the folder that timed it, so a
point trained later is compared in a run of its own on the same prompts. τ is the same in any run for greedy
decoding; a speedup is each run's own ratio against its own vanilla.

The logic is train/training/data_scaling.py. Writes ``curve.csv``, ``curve.md`` (the table and the fits) and
``curve.png`` under ``--out``. The fit is τ = a + b · ln(trained tokens), least squares over the points, per τ column;
it says how many tokens would reach ``--goal`` if the trend held. With fewer than two points, or a slope ≤ 0, it says so
instead of extrapolating.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from treespec.train.training.data_scaling import add_comparison, read_point, write_curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="NAME=DIR",
                        help="a point: its training run's folder, or that run's summary.json")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=DIR",
                        help="a comparison run timing points' drafters under the points' NAMEs (a LABEL may be "
                             "given several runs: each point is read from the one that timed it)")
    parser.add_argument("--goal", type=float, default=3.5, help="the τ to extrapolate to")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if any("=" not in spec for spec in args.run + args.compare):
        raise SystemExit("--run and --compare take NAME=DIR")
    rows = [read_point(name, Path(folder)) for name, folder in (spec.split("=", 1) for spec in args.run)]
    rows.sort(key=lambda r: r["trained_tokens"])
    comparisons: dict[str, list[Path]] = {}
    for spec in args.compare:
        label, folder = spec.split("=", 1)
        comparisons.setdefault(label, []).append(Path(folder))
    for label, folders in comparisons.items():
        add_comparison(rows, label, folders)
    print(write_curve(rows, args.goal, args.out))


if __name__ == "__main__":
    main()

"""The architecture matrix: which stock transformers families treespec decodes losslessly, with which drafters.

    python scripts/architecture_matrix.py                 # ~1 min on one core
    python scripts/architecture_matrix.py --out PATH      # default results/architecture_matrix.md

Runs the checks of train/checks/architectures.py (the functions tests/train/checks/test_architectures.py runs, on
the same family table: tiny random models, prompts longer than the sliding window) and writes a markdown file
generated from their results (train/checks/matrix_report.py): ✓ with τ, ✗ with the error, n/a where transformers
itself offers no such combination.
"""

import argparse
from pathlib import Path

from treespec.train.checks import matrix_report

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "results" / "architecture_matrix.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    matrix_report.run(args.out, args.threads)


if __name__ == "__main__":
    main()

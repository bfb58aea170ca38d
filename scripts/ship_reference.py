"""Ship the trained reference models: copy them into treespec/models/, write held-out prompts, measure
the seed's α and c, predicted vs measured chain speedups, and write the model card
(train/training/reference_models.py).

    python scripts/ship_reference.py                  # after scripts/train_reference.sh
    python scripts/ship_reference.py --skip-copy      # re-measure the shipped models only
"""

import argparse
from pathlib import Path

from treespec.train.training import reference_models

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    reference_models.run(args, ROOT)


if __name__ == "__main__":
    main()

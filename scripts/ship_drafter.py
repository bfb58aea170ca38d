"""Ship a trained drafter for the reference target: copy ``runs/heads/<name>/final`` into
treespec/models/<name> with its training summary, and (re)measure its per-depth top-k accuracies against
the target's greedy tokens on held-out text (``head_accuracy.json``, the input of accuracy-grown trees).

    python scripts/ship_drafter.py medusa              # after scripts/train_heads.py drafter=medusa
    python scripts/ship_drafter.py eagle               # after scripts/train_heads.py drafter=eagle data=stdlib ...
    python scripts/ship_drafter.py medusa --skip-copy  # re-measure the shipped drafter only
"""

import argparse
import json
import shutil
from pathlib import Path

from treespec import reference
from treespec.heads.base import ACCURACY_FILE
from treespec.train.data import held_out_windows

ROOT = Path(__file__).resolve().parents[1]
WINDOWS, WINDOW_LEN = 32, 256  # the training runs' validation windows (conf/train_heads.yaml trainer)


def accuracy(name: str, folder: Path, target, windows) -> list[list[float]]:
    if name == "medusa":
        from treespec.heads.medusa import MedusaHeads
        from treespec.train.heads import head_accuracy

        return head_accuracy(target, MedusaHeads.from_pretrained(folder, target), windows)
    from treespec.heads.eagle import EagleModel
    from treespec.train.eagle import depth_rank_accuracy

    return depth_rank_accuracy(target, EagleModel.from_pretrained(folder, target), windows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=["medusa", "eagle"])
    parser.add_argument("--skip-copy", action="store_true")
    args = parser.parse_args()
    out = reference.MODELS_DIR / args.name
    if not args.skip_copy:
        run_dir = ROOT / "runs" / "heads" / args.name
        if not (run_dir / "final").is_dir():
            raise FileNotFoundError(f"{run_dir / 'final'} does not exist: train it first (scripts/train_heads.py)")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(run_dir / "final", out)
        shutil.copy(run_dir / "summary.json", out / "training_summary.json")

    target, tokenizer = reference.load("target")
    windows = held_out_windows(tokenizer, WINDOW_LEN, WINDOWS, ROOT / ".cache" / "data")
    acc = accuracy(args.name, out, target, windows)
    (out / ACCURACY_FILE).write_text(json.dumps(acc))
    print(f"{args.name}: top-1 per depth " + " ".join(f"{row[0]:.3f}" for row in acc))
    print("         top-5 per depth " + " ".join(f"{sum(row[:5]):.3f}" for row in acc))


if __name__ == "__main__":
    main()

"""Ship a trained drafter for the reference target: copy ``runs/heads/<name>/final`` into
treespec/models/<name> with its training summary, and (re)measure its per-depth top-k accuracies against
the target's greedy tokens on held-out text (``head_accuracy.json``, the input of accuracy-grown trees).

    python scripts/ship_drafter.py medusa              # after scripts/train_heads.py drafter=medusa
    python scripts/ship_drafter.py eagle               # after scripts/train_heads.py experiment=reference_eagle
    python scripts/ship_drafter.py medusa --skip-copy  # re-measure the shipped drafter only
    python scripts/ship_drafter.py eagle3 --run-dir /root/runs/eagle3_ttt7   # a run elsewhere (run_dir=...)
"""

import argparse
import shutil
from pathlib import Path

from treespec import reference
from treespec.heads import registry
from treespec.heads.accuracy import write_accuracy
from treespec.train.data import held_out_windows

ROOT = Path(__file__).resolve().parents[1]
WINDOWS, WINDOW_LEN = 32, 256  # the training runs' validation windows (conf/trainer/heads.yaml)


def main() -> None:
    trainable = [kind.name for kind in registry.KINDS
                 if kind.has_weights and kind.name not in ("draft", "auto")]  # drafters trained by train_heads.py
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=trainable)
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--run-dir", type=Path, default=None, help="the training run (default: runs/heads/<name>)")
    args = parser.parse_args()
    out = reference.MODELS_DIR / args.name
    if not args.skip_copy:
        run_dir = args.run_dir or ROOT / "runs" / "heads" / args.name
        if not (run_dir / "final").is_dir():
            raise FileNotFoundError(f"{run_dir / 'final'} does not exist: train it first (scripts/train_heads.py)")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(run_dir / "final", out)
        shutil.copy(run_dir / "summary.json", out / "training_summary.json")

    target, tokenizer = reference.load("target")
    windows = held_out_windows(tokenizer, WINDOW_LEN, WINDOWS, ROOT / ".cache" / "data")
    module = registry.load(args.name, target, out)
    acc = registry.get(args.name).rank_accuracy(target, module, windows)
    write_accuracy(out, acc)
    print(f"{args.name}: top-1 per depth " + " ".join(f"{row[0]:.3f}" for row in acc))
    print("         top-5 per depth " + " ".join(f"{sum(row[:5]):.3f}" for row in acc))


if __name__ == "__main__":
    main()

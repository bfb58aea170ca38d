"""Run the frozen target once over the training data and store what the drafter trains on (train/training/features.py).
Takes train_heads' overrides; train with the same ones to read the features instead of running the target:

    python scripts/prepare_features.py drafter=eagle data=chat data.chat.source=convs.jsonl data.features=feats/eagle
    torchrun --nproc_per_node 4 scripts/prepare_features.py ...          # the shards shared over 4 processes
    python scripts/train_heads.py drafter=eagle data=chat data.chat.source=convs.jsonl data.features=feats/eagle

Resumable: rerun the same command and finished shards are kept. The config is composed without a hydra run
folder, so nothing is written into a training run's folder.
"""

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from treespec.train.training.drafter_job import prepare_features


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_heads", overrides=overrides)
    prepare_features(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Replace the assistant turns of a conversation file with the target's own responses (train/training/regeneration.py),
so that a drafter learns what the target says. Takes train_heads' overrides:

    python scripts/regenerate.py data=chat data.chat.source=sharegpt.jsonl data.regenerate.out=regen.jsonl
    python scripts/regenerate.py ... data.regenerate.temperature=0.7 data.regenerate.batch_size=32
    torchrun --nproc_per_node 4 scripts/regenerate.py ...                 # rows shared over 4 processes

Resumable: rerun the same command and rows already written are skipped. The config is composed without a
hydra run folder.
"""

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from treespec.train.training import regeneration as regenerate


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="train_heads", overrides=overrides)
    regenerate.run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])

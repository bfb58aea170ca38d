"""Train a reference language model (see conf/train_lm.yaml).

    python scripts/train_lm.py model=target
    python scripts/train_lm.py model=draft trainer.threads=1
    python scripts/train_lm.py model=target resume=true     # continue an interrupted run
"""

import hydra

from treespec.train.lm import run


@hydra.main(config_path="../conf", config_name="train_lm", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    main()

"""Train draft heads on a frozen target (see conf/train_heads.yaml).

    python scripts/train_heads.py drafter=medusa
    python scripts/train_heads.py drafter=medusa data=stdlib logger=none   # corpus text, no wandb
    python scripts/train_heads.py drafter=medusa resume=true               # continue an interrupted run
    python scripts/train_heads.py drafter=eagle                            # EAGLE drafter, dynamic-tree eval
"""

import os
import sys

import hydra

from treespec.train.training.drafter_job import run


@hydra.main(config_path="../conf", config_name="train_heads", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: only rank 0 writes hydra's .hydra/ and job log
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    main()

"""Train a reference language model (see conf/train_lm.yaml).

    python scripts/train_lm.py model=target
    python scripts/train_lm.py model=draft trainer.threads=1
    python scripts/train_lm.py model=target resume=true     # continue an interrupted run
"""

import os
import sys

import hydra

from treespec.train.training.lm_job import run


@hydra.main(config_path="../conf", config_name="train_lm", version_base="1.3")
def main(cfg) -> None:
    run(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: only rank 0 writes hydra's .hydra/ and job log
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    main()

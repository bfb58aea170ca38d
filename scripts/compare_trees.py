"""Compare drafters × trees on a target and a workload (see conf/compare.yaml, conf/workload/, docs/workloads.md).

    python scripts/compare_trees.py                                  # the small default budget (< 3 min)
    python scripts/compare_trees.py experiment=compare_full          # the README's full table
    python scripts/compare_trees.py -m tree=chain,full,accuracy      # one run per tree config
    python scripts/compare_trees.py 'trees=[{kind: chain, depth: [1,2,3]}]' drafters=[draft]
    python scripts/compare_trees.py drafters=[eagle,eagle_sample] temperature=1.0   # conf/drafter/ entries
    python scripts/compare_trees.py workload=jsonl workload.path=question.jsonl drafters=[eagle,prompt_lookup]
    python scripts/compare_trees.py target=/models/chat available.upstream.source=/models/head  # your own pair
    python scripts/compare_trees.py workload=dataset workload.name=/data/gsm8k workload.columns.prompt=question
    python scripts/compare_trees.py report=runs/compare/RUN          # re-render a run's report, no measuring
    python scripts/compare_trees.py compare=runs/compare/A,runs/compare/B   # two (or more) runs side by side
"""

import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig

from treespec.train.compare.job import run_job
from treespec.train.compare.stamp import command_line

COMMAND = command_line()  # as typed, before the argument rewrite below


def quote_compare_paths(argv: list[str]) -> list[str]:
    """``compare=A,B`` is a sweep to hydra (an error without -m); pass it on as the list ``compare=['A','B']``."""
    out = []
    for arg in argv:
        if arg.startswith("compare=") and not arg.startswith("compare=[") and "," in arg:
            paths = [p for p in arg[len("compare="):].split(",") if p]
            arg = "compare=[" + ",".join("'" + p.replace("'", "\\'") + "'" for p in paths) + "]"
        out.append(arg)
    return out


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
def main(cfg) -> None:
    started = time.perf_counter()
    out_dir = HydraConfig.get().runtime.output_dir
    job = run_job(cfg, out_dir, command=COMMAND)
    print()
    print(job["markdown"].split("\n<details>")[0])
    if job["mode"] == "measure":
        print(f"best: {job['best']}")
    print(f"outputs: {job['outputs']}  ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *quote_compare_paths(sys.argv[1:])]
    main()

"""Compare drafters × trees on the reference models (see conf/compare.yaml).

    python scripts/compare_trees.py                                  # the small default budget (< 3 min)
    python scripts/compare_trees.py experiment=compare_full          # the README's full table
    python scripts/compare_trees.py -m tree=chain,full,accuracy      # one run per tree config
    python scripts/compare_trees.py 'trees=[{kind: chain, depth: [1,2,3]}]' drafters=[draft]
    python scripts/compare_trees.py drafters=[eagle,eagle_sample] temperature=1.0   # conf/drafter/ entries
"""

import hydra
from hydra.core.hydra_config import HydraConfig

from treespec.train.compare import run_from_config


@hydra.main(config_path="../conf", config_name="compare", version_base="1.3")
def main(cfg) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    result = run_from_config(cfg, out_dir)
    print()
    print(open(f"{out_dir}/results.md").read())
    print(f"best: {result['best']}\noutputs: {out_dir}")


if __name__ == "__main__":
    main()

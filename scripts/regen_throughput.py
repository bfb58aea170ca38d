"""Answer tokens per second of the two regeneration backends (train/checks/regen_backends.py) on the same
self-written requests (SmolLM2's shipped ones by default), greedy: the embedded backend at batch 1, 16 and 64, an
OpenAI-compatible server at 1, 16 and 64 requests in flight. Each backend answers one warm-up request first; a
vLLM started here starts after the embedded runs.

    python scripts/regen_throughput.py --out results/regen_throughput --requests 64 --max-new-tokens 256 --threads 2
    python scripts/regen_throughput.py --out /tmp/t --url http://127.0.0.1:8000          # a server already running

Writes throughput.md and throughput.json to --out. Time it on an idle machine: both backends share its cores.
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from treespec.train.checks import regen_backends as checks
from treespec.train.training.completions import EmbeddedBackend


def widths(text: str) -> list[int]:
    return [int(w) for w in text.split(",") if w]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checks.add_arguments(parser, requests=64, max_new_tokens=256)
    parser.add_argument("--batches", type=widths, default=[1, 16, 64], help="the embedded backend's batch sizes")
    parser.add_argument("--concurrency", type=widths, default=[1, 16, 64], help="the server's requests in flight")
    args = parser.parse_args()
    rows = []
    with checks.session(args, max_num_seqs=max(args.concurrency)) as s:
        embedded = EmbeddedBackend(s.target, s.tokenizer, s.renderer.end_marker)
        for make, sizes in ((lambda: embedded, args.batches), (s.server, args.concurrency)):
            backend = make()  # a vLLM started here starts after the embedded runs
            backend.complete(s.prompts[:1], max_new_tokens=4)  # warm-up
            for width in sizes:
                rows.append(checks.throughput(backend, s.prompts, max_new_tokens=args.max_new_tokens, width=width))
                print(rows[-1], flush=True)
    settings = {**vars(args), "url": s.url, "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine()}
    text = (f"{args.target}: {args.requests} requests from {args.source}, at most {args.max_new_tokens} answer tokens "
            f"each, greedy; {args.threads} thread(s); server {s.url}\n\n" + checks.throughput_table(rows))
    print(text)
    (Path(args.out) / "throughput.md").write_text(text)
    (Path(args.out) / "throughput.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

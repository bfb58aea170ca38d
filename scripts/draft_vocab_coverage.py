"""How big a reduced draft vocabulary (EAGLE-3's d2t/t2d, FR-Spec) should be for a target and its training data:
for each size K, the share of held-out assistant tokens the K most frequent training tokens cover (a token outside
the draft vocabulary can never be drafted, so this caps every depth's acceptance), beside the cost of the draft
head's K×H matmul for a few rows, relative to the full vocabulary's (what each drafted depth pays).

    python scripts/draft_vocab_coverage.py --target smollm2 --data treespec/models/smollm2/magpie.jsonl

Ties (tokens never seen in training) go to the smaller id, as heads/drafting/vocab.py's DraftVocab ranks them: byte-pair
ids are roughly in merge order, i.e. by frequency in the tokenizer's own corpus. The last ``--held-out`` share of
the rows is held out.
"""

import argparse
import json

import torch

from treespec import reference
from treespec.timing import median_time


def assistant_tokens(rows: list[dict], tokenizer) -> list[int]:
    ids = []
    for row in rows:
        for message in row.get("messages") or []:
            if message.get("role") == "assistant":
                ids += tokenizer(message["content"], add_special_tokens=False)["input_ids"]
    return ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", required=True, help="OpenAI-style chat JSONL ({'messages': [...]} per row)")
    parser.add_argument("--held-out", type=float, default=0.1)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 12288, 16384, 24576, 32768])
    parser.add_argument("--rows", type=int, default=8, help="draft-head rows per timed matmul (a depth's nodes)")
    args = parser.parse_args()
    target, tokenizer = reference.load(args.target)
    with open(args.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cut = int(len(rows) * (1 - args.held_out))
    train_ids, held_ids = assistant_tokens(rows[:cut], tokenizer), assistant_tokens(rows[cut:], tokenizer)
    weight = target.get_output_embeddings().weight.detach()  # [V, H]
    vocab = weight.shape[0]
    counts = torch.bincount(torch.tensor(train_ids), minlength=vocab).float()
    order = sorted(range(vocab), key=lambda t: (-counts[t].item(), t))
    held = torch.bincount(torch.tensor(held_ids), minlength=vocab).float()
    x = torch.randn(args.rows, weight.shape[1])
    full = median_time(lambda: x @ weight.T, 20)
    print(f"{len(train_ids)} training and {len(held_ids)} held-out assistant tokens; "
          f"{int((counts > 0).sum())} distinct in training; vocabulary {vocab}")
    print("| K | held-out coverage | head matmul ÷ full vocabulary's |\n|---|---|---|")
    for k in args.sizes + [vocab]:
        ids = torch.tensor(order[:k])
        head = weight[ids].contiguous()
        print(f"| {k} | {held[ids].sum().item() / held.sum().item():.3f} | "
              f"{median_time(lambda head=head: x @ head.T, 20) / full:.2f} |")


if __name__ == "__main__":
    main()

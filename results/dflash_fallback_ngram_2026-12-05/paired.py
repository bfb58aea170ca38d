"""Two configurations of one comparison run, prompt by prompt: the median of the per-prompt-run ratio of tokens/s
(both timed interleaved, on the same prompt), a bootstrap 95 % interval of that median over prompts (a prompt's
repeats resampled together, as the comparison's intervals are), how many
prompt runs the first won, and the ratio of total times (Spec-Bench's measure). From the repository root:

    python results/dflash_fallback_ngram_2026-12-05/paired.py runs/compare/dflash_fallback_ngram_r3 \
        "fb24 | chain γ=7" "pl14 | chain γ=7" "prompt_lookup | chain γ=7"
"""

import json
import random
import statistics
import sys


def main(run: str, first: str, others: list[str]) -> None:
    with open(f"{run}/results.json") as f:
        result = json.load(f)
    records = {r["config"]: r for r in result["records"]}
    prompt_of = result["prompt_of_run"]  # prompt index of each prompt run
    tokens_per_s = {name: records[name]["runs"]["tokens_per_s"] for name in (first, *others)}
    for other in others:
        ratios = [a / b for a, b in zip(tokens_per_s[first], tokens_per_s[other], strict=True)]
        by_prompt = {}
        for p, r in zip(prompt_of, ratios, strict=True):
            by_prompt.setdefault(p, []).append(r)
        groups, rng = list(by_prompt.values()), random.Random(0)
        medians = sorted(statistics.median([r for g in rng.choices(groups, k=len(groups)) for r in g])
                         for _ in range(2000))
        total = sum(1 / b for b in tokens_per_s[other]) / sum(1 / a for a in tokens_per_s[first])
        low, high = medians[50], medians[1949]
        print(f"{first} ÷ {other}: median {statistics.median(ratios):.3f} (95 % {low:.3f}–{high:.3f}), "
              f"faster on {sum(r > 1 for r in ratios)}/{len(ratios)} prompt runs, total time {total:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

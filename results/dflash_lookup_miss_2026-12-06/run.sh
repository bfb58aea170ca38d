# Prompt lookup with DFlash as its fallback (drafter lookup_dflash: n-grams 4 down to 2, then reference:dflash_fallback,
# trained where prompt lookup misses, with a 2,048-token FR-Spec head, on DDTree 7), beside the same pairing with the
# block shipped for drafting alone (fb24: reference:dflash), prompt lookup (defaults, and n-grams 4 down to 1: pl14),
# EAGLE-3 and each block alone; chains of 7 and 10 for prompt lookup and the pairing. 24 held-out code prompts × 64
# tokens, greedy, 2 threads, nothing else running. From the repository root:
#   bash results/dflash_lookup_miss_2026-12-06/run.sh repeats=3
set -euo pipefail
cd "$(dirname "$0")/../.."
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
CHAINS='[{kind: chain, depth: [7, 10]}]'
python scripts/compare_trees.py 'drafters=[prompt_lookup,pl14,eagle3,dflash,dflash_fallback,fb24,lookup_dflash]' \
  "+available.prompt_lookup.trees=$CHAINS" \
  "+drafter@available.pl14=prompt_lookup" "available.pl14.max_ngram=4" "+available.pl14.trees=$CHAINS" \
  "+drafter@available.fb24=lookup_dflash" "available.fb24.parts=[lookup24,dflash]" "available.fb24.trees=[{kind: chain, depth: 7}]" \
  "+available.eagle3.trees=[{kind: chain, depth: 7}]" "+available.dflash.trees=[$DD7]" \
  "+available.dflash_fallback.trees=[$DD7]" \
  'trees=[{kind: chain, depth: 7}]' prompts=24 max_new_tokens=64 threads=2 logger=none \
  run_dir=${RUN:-runs/compare/dflash_lookup_miss} "$@"

# The block trained with position_decay 0.6 (1,000 steps from reference:dflash, seed 1: RUN_D06) against the shipped one,
# alone on DDTree 7 and as prompt lookup's (n-grams 2-4) fallback, beside prompt lookup (n-grams 1-4); the 24 held-out
# code prompts × 64 tokens, three repeats, greedy, 2 threads. The training run:
#   python scripts/train_heads.py experiment=reference_dflash2 drafter.num_layers=1 drafter.position_decay=0.6 run_dir=runs/dflash_decay06
set -euo pipefail
cd "$(dirname "$0")/../.."
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
python scripts/compare_trees.py 'drafters=[pl14,dflash,d06,fb24,fb24_d06]' \
  +drafter@available.pl14=prompt_lookup available.pl14.max_ngram=4 \
  +drafter@available.pl24=prompt_lookup available.pl24.max_ngram=4 available.pl24.min_ngram=2 \
  +drafter@available.d06=dflash available.d06.source=${RUN_D06:-runs/dflash_decay06}/final \
  +drafter@available.fb24=combined 'available.fb24.parts=[pl24,dflash]' available.fb24.mode=fallback "available.fb24.part_trees=[null, $DD7]" \
  +drafter@available.fb24_d06=combined 'available.fb24_d06.parts=[pl24,d06]' available.fb24_d06.mode=fallback "available.fb24_d06.part_trees=[null, $DD7]" \
  "+available.dflash.trees=[$DD7]" "+available.d06.trees=[$DD7]" \
  'trees=[{kind: chain, depth: 7}]' repeats=3 prompts=24 max_new_tokens=64 threads=2 logger=none \
  run_dir=${RUN:-runs/compare/dflash_decay06} "$@"

# The block trained on the target's own greedy continuations (experiment=reference_dflash_greedy, its final/ in
# $BLOCK) against the shipped one trained on corpus text, each alone (DDTree 7) and as the fallback of prompt lookup
# with n-grams 4 down to 2 (fb24), beside prompt lookup (defaults, and n-grams 4 down to 1), EAGLE and EAGLE-3:
# 24 held-out code prompts × 64 tokens, greedy, 2 threads, nothing else running. From the repository root:
#   BLOCK=runs/heads/dflash_greedy/final bash results/dflash_greedy_2026-12-05/run.sh repeats=3
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${BLOCK:?set BLOCK to the greedy-data block's folder (a training run's final/)}"
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
args=("+drafter@available.pl14=prompt_lookup" "available.pl14.max_ngram=4"
      "+drafter@available.pl24=prompt_lookup" "available.pl24.max_ngram=4" "available.pl24.min_ngram=2"
      "+drafter@available.dflash_greedy=dflash" "available.dflash_greedy.source=$BLOCK")
for label in fb24 fb24_greedy; do
  args+=("+drafter@available.$label=combined" "available.$label.mode=fallback" "+available.$label.trees=[{kind: chain, depth: 7}]"
         "available.$label.part_trees=[null, $DD7]")
done
args+=("available.fb24.parts=[pl24,dflash]" "available.fb24_greedy.parts=[pl24,dflash_greedy]")
python scripts/compare_trees.py 'drafters=[prompt_lookup,pl14,eagle,eagle3,dflash,dflash_greedy,fb24,fb24_greedy]' "${args[@]}" \
  "+available.dflash.trees=[$DD7]" "+available.dflash_greedy.trees=[$DD7]" \
  'trees=[{kind: chain, depth: 7}]' prompts=24 max_new_tokens=64 threads=2 logger=none \
  run_dir=${RUN:-runs/compare/dflash_greedy} "$@"

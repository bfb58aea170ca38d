# Prompt lookup's n-gram sizes, alone and as the first part of DFlash's fallback pairing, beside EAGLE and EAGLE-3:
# 24 held-out code prompts × 64 tokens, greedy, 2 threads, nothing else running. From the repository root:
#   bash results/dflash_fallback_ngram_2026-12-05/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
args=()
for label in pl14 pl24; do
  args+=("+drafter@available.$label=prompt_lookup" "available.$label.max_ngram=4")
done
args+=("available.pl24.min_ngram=2")
for label in fb fb24; do
  args+=("+drafter@available.$label=combined" "available.$label.mode=fallback" "+available.$label.trees=[{kind: chain, depth: 7}]"
         "available.$label.part_trees=[null, $DD7]")
done
args+=("available.fb.parts=[prompt_lookup,dflash]" "available.fb24.parts=[pl24,dflash]")
python scripts/compare_trees.py 'drafters=[prompt_lookup,pl14,pl24,eagle,eagle3,fb,fb24]' "${args[@]}" \
  '+available.prompt_lookup.trees=[{kind: chain, depth: [4, 7]}]' '+available.pl14.trees=[{kind: chain, depth: [4, 7]}]' \
  '+available.pl24.trees=[{kind: chain, depth: [4, 7]}]' '+available.eagle.trees=[{kind: chain, depth: [4, 7]}]' \
  '+available.eagle3.trees=[{kind: chain, depth: [4, 7]}]' 'trees=[{kind: chain, depth: 7}]' \
  prompts=24 max_new_tokens=64 threads=2 logger=none run_dir=${RUN:-runs/compare/dflash_fallback_ngram} "$@"

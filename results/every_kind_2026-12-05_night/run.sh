# Every drafter kind on the reference models, as results/every_kind_2026-12-05/ ran them, with reference:dflash now
# the block trained on the target's greedy continuations (conf/experiment/reference_dflash_greedy.yaml) and prompt
# lookup's fallback pairing leaving one-token matches to DFlash (its prompt lookup with n-grams 4 down to 2):
# 24 held-out code prompts × 64 tokens, greedy, 2 threads, nothing else running. From the repository root:
#   bash results/every_kind_2026-12-05_night/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python scripts/compare_trees.py \
  'drafters=[draft,prompt_lookup,recycling,suffix,rest,lookahead,medusa,hydra,eagle,eagle3,combined,dflash,pl_dflash]' \
  +drafter@available.pl24=prompt_lookup available.pl24.max_ngram=4 available.pl24.min_ngram=2 \
  +drafter@available.pl_dflash=combined 'available.pl_dflash.parts=[pl24,dflash]' available.pl_dflash.mode=fallback \
  'available.pl_dflash.part_trees=[null, {kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}]' \
  '+available.pl_dflash.trees=[{kind: chain, depth: [4, 7]}]' \
  'trees=[{kind: chain, depth: [2, 4, 7]}, {kind: accuracy, nodes: 16}, {kind: dynamic, total_tokens: 16, depth: 5, top_k: 4}, {kind: auto}, {kind: default}]' \
  prompts=24 max_new_tokens=64 threads=2 logger=none run_dir=${RUN:-runs/compare/every_kind_2026-12-05_night} "$@"

# Every drafter kind on the reference models, as results/every_kind_2026-12-05_night/ ran them, with prompt lookup's
# DFlash pairing now the comparison's entry lookup_dflash (its block reference:dflash_fallback, trained where prompt
# lookup misses; conf/drafter/lookup_dflash.yaml): 24 held-out code prompts × 64 tokens, greedy, 2 threads, nothing
# else running. From the repository root:
#   bash results/every_kind_2026-12-06/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python scripts/compare_trees.py \
  'drafters=[draft,prompt_lookup,recycling,suffix,rest,lookahead,medusa,hydra,eagle,eagle3,combined,dflash,lookup_dflash]' \
  'trees=[{kind: chain, depth: [2, 4, 7]}, {kind: accuracy, nodes: 16}, {kind: dynamic, total_tokens: 16, depth: 5, top_k: 4}, {kind: auto}, {kind: default}]' \
  prompts=24 max_new_tokens=64 threads=2 logger=none run_dir=${RUN:-runs/compare/every_kind_2026-12-06} "$@"

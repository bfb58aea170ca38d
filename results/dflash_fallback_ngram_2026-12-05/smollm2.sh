# The same question on SmolLM2's held-out conversations: prompt lookup's n-gram sizes alone and as the first part of
# reference:smollm2/dflash's fallback pairing, 8 held-out conversations × 128 tokens (the data-scaling curve's,
# results/scaling_smollm2/), greedy, 2 threads. FIRST: the first 4,032 rows of treespec/models/smollm2/chat.jsonl.gz
# (python -c "import gzip,itertools,sys; sys.stdout.writelines(itertools.islice(gzip.open('treespec/models/smollm2/chat.jsonl.gz','rt'),4032))" > first4032.jsonl)
set -euo pipefail
cd "$(dirname "$0")/../.."
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
CH='[{kind: chain, depth: [4, 7]}]'
python scripts/compare_trees.py target=smollm2 assistant=null logger=none threads=2 workload=jsonl \
  workload.path=${FIRST:-first4032.jsonl} workload.chat_validation=0.02 workload.held_out=24 workload.per_category=null \
  workload.prompts=8 max_new_tokens=128 run_dir=${RUN:-runs/compare/smollm2_fallback_ngram} \
  available.dflash.source=reference:smollm2/dflash \
  +drafter@available.pl14=prompt_lookup available.pl14.max_ngram=4 \
  +drafter@available.pl24=prompt_lookup available.pl24.max_ngram=4 available.pl24.min_ngram=2 \
  +drafter@available.fb=combined 'available.fb.parts=[prompt_lookup,dflash]' available.fb.mode=fallback \
  "available.fb.part_trees=[null, $DD7]" "+available.fb.trees=$CH" \
  +drafter@available.fb24=combined 'available.fb24.parts=[pl24,dflash]' available.fb24.mode=fallback \
  "available.fb24.part_trees=[null, $DD7]" "+available.fb24.trees=$CH" \
  "+available.prompt_lookup.trees=$CH" "+available.pl14.trees=$CH" \
  'drafters=[prompt_lookup,pl14,fb,fb24]' 'trees=[{kind: chain, depth: 7}]' "$@"

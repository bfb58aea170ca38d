cd "$(dirname "$0")/../.."
DD7='{kind: dynamic, total_tokens: 7, depth: 7, top_k: 4}'
args=()
for m in 1 3 5 7; do
  d=fb_min$m
  args+=("+drafter@available.$d=combined" "available.$d.parts=[prompt_lookup,dflash]" "available.$d.mode=fallback"
         "available.$d.min_nodes=$m" "+available.$d.trees=[{kind: chain, depth: 7}]" "available.$d.part_trees=[null, $DD7]")
done
python scripts/compare_trees.py 'drafters=[prompt_lookup,fb_min1,fb_min3,fb_min5,fb_min7]' "${args[@]}" \
  'trees=[{kind: chain, depth: 7}]' peers=false \
  prompts=24 max_new_tokens=64 threads=2 logger=none run_dir=${RUN:-runs/compare/dflash_min_nodes} "$@"

#!/usr/bin/env bash
# The GPU check, one prepared script (at most 10 minutes on one H200), everything under one output folder:
#   1. the GPU-marked tests: greedy equality and chi-square sampling on CUDA, fp32 and bf16, sdpa, eager and
#      flex_attention (tests/test_gpu.py), plus the whole losslessness suite on the device;
#   2. the cost curve of the reference target and of a random-weight Llama-3-8B-shaped model (bf16);
#   3. the tree comparison on the reference models, on the device.
#
#   bash scripts/gpu_check.sh                      # on a GPU machine: writes runs/gpu_check/<time>/
#   bash scripts/gpu_check.sh --device cpu --out DIR   # the dry run (tiny sizes, seconds; CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
OUT="runs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "unknown argument $1 (use --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TREESPEC_TEST_DEVICE="$DEVICE" WANDB_MODE=offline
{ echo "device=$DEVICE"; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; git rev-parse HEAD; } \
  > "$OUT/environment.txt" 2>&1

if [ "$DEVICE" = cpu ]; then  # dry run: every step at toy sizes, so CI proves the script works end to end
  "$PY" -m pytest -q tests/test_gpu.py -k "sdpa and chain or bf16" 2>&1 | tee "$OUT/tests.log"
  "$PY" scripts/cost_curve.py --device cpu --model tiny --sizes 1 2 4 --repeats 2 --out "$OUT" 2>&1 | tee "$OUT/cost_curve.log"
  exit 0
fi

"$PY" -m pytest -q tests/test_gpu.py 2>&1 | tee "$OUT/tests.log"
"$PY" scripts/cost_curve.py --device cuda --dtype bfloat16 --model reference --model llama3-8b --out "$OUT" 2>&1 \
  | tee "$OUT/cost_curve.log"
"$PY" scripts/compare_trees.py device=cuda "run_dir=$OUT/compare" logger=none peers=true 2>&1 | tee "$OUT/compare.log"
echo "gpu check: outputs in $OUT"

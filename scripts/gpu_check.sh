#!/usr/bin/env bash
# The GPU check, one prepared script, everything under one output folder (parts 1, 3 and 4 were sized for 10 minutes
# on one H200; part 2 adds a few: flex_attention's compilation, building the 8B-shaped model, its decoding):
#   1. the GPU-marked tests: greedy equality and chi-square sampling on CUDA, fp32 and bf16, sdpa, eager and
#      flex_attention (tests/core/test_gpu.py), and cascade attention (tests/core/test_cascade_attention.py: the flash
#      kernel against the pure-torch one, greedy equality through flash-attn);
#   2. flash-attn, installed when a wheel is available (tolerated when not: the cascade then runs its pure-torch
#      kernel, and the log says so), and the attention implementations side by side (scripts/attention_timing.py:
#      sdpa, flex_attention and cascade attention; T(N)/T(1) and decoding speedups on the reference target and on
#      a random-weight Llama-3-8B-shaped model, bf16);
#   3. the cost curve of the reference target and of the 8B-shaped model (bf16);
#   4. the tree comparison on the reference models, on the device.
#
#   bash scripts/gpu_check.sh                        # on a GPU machine: writes runs/gpu_check/<time>/
#   bash scripts/gpu_check.sh --cascade-only         # only part 2 and the cascade tests (a short device session)
#   bash scripts/gpu_check.sh --dry-run [--out DIR]  # CPU, toy sizes, a couple of minutes (also: --device cpu,
#                                                    # and the default on a machine without CUDA)
# FLASH_ATTN_WHEEL=/path/flash_attn-....whl installs that wheel (a machine without network);
# FLASH_INSTALL_TIMEOUT (seconds, default 300) bounds the install: pip would otherwise build from source for an hour.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
OUT="runs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)"
CASCADE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --dry-run) DEVICE=cpu; shift ;;
    --cascade-only) CASCADE_ONLY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "unknown argument $1 (use --dry-run, --device cuda|cpu, --cascade-only, --out DIR)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device here: running the CPU dry run instead" >&2
  DEVICE=cpu
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TREESPEC_TEST_DEVICE="$DEVICE" WANDB_MODE=offline
{ echo "device=$DEVICE"; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; git rev-parse HEAD; } \
  > "$OUT/environment.txt" 2>&1

flash_status() {  # one line: whether flash-attn imports, and its version
  "$PY" -c "import flash_attn; print('flash-attn', flash_attn.__version__)" 2>/dev/null \
    || echo "flash-attn: not available"
}

install_flash() {  # tolerated failure: the cascade then runs its pure-torch kernel
  if "$PY" -c "import flash_attn" 2>/dev/null; then
    echo "flash-attn already installed"
    return 0
  fi
  local what=(flash-attn --no-build-isolation)
  [ -n "${FLASH_ATTN_WHEEL:-}" ] && what=("$FLASH_ATTN_WHEEL")
  if timeout "${FLASH_INSTALL_TIMEOUT:-300}" "$PY" -m pip install "${what[@]}"; then
    echo "flash-attn installed"
  else
    echo "flash-attn could NOT be installed (no wheel for this torch / CUDA / Python, no network, or the build ran" \
         "past ${FLASH_INSTALL_TIMEOUT:-300} s): cascade attention is timed with its pure-torch kernel; going on"
  fi
}

if [ "$DEVICE" = cpu ]; then  # dry run: every step at toy sizes, so CI proves the script works end to end
  echo "flash-attn install skipped (dry run, no CUDA); $(flash_status)" | tee "$OUT/flash_attn_install.log"
  "$PY" -m pytest -q tests/core/test_gpu.py -k "sdpa and chain or bf16" 2>&1 | tee "$OUT/tests.log"
  "$PY" -m pytest -q tests/core/test_cascade_attention.py 2>&1 \
    | tee "$OUT/tests_cascade.log"
  "$PY" scripts/attention_timing.py --dry-run --out "$OUT/attention" 2>&1 | tee "$OUT/attention_timing.log"
  [ "$CASCADE_ONLY" = 1 ] && exit 0
  "$PY" scripts/cost_curve.py --device cpu --model tiny --sizes 1 2 4 --repeats 2 --out "$OUT" 2>&1 | tee "$OUT/cost_curve.log"
  exit 0
fi

install_flash 2>&1 | tee "$OUT/flash_attn_install.log"
flash_status | tee -a "$OUT/environment.txt"
"$PY" -m pytest -q tests/core/test_cascade_attention.py 2>&1 | tee "$OUT/tests_cascade.log" || true
"$PY" scripts/attention_timing.py --device cuda --dtype bfloat16 --model reference --model llama3-8b \
  --out "$OUT/attention" 2>&1 | tee "$OUT/attention_timing.log" || true
[ "$CASCADE_ONLY" = 1 ] && { echo "gpu check (cascade only): outputs in $OUT"; exit 0; }
"$PY" -m pytest -q tests/core/test_gpu.py 2>&1 | tee "$OUT/tests.log"
"$PY" scripts/cost_curve.py --device cuda --dtype bfloat16 --model reference --model llama3-8b --out "$OUT" 2>&1 \
  | tee "$OUT/cost_curve.log"
"$PY" scripts/compare_trees.py device=cuda "run_dir=$OUT/compare" logger=none peers=true 2>&1 | tee "$OUT/compare.log"
echo "gpu check: outputs in $OUT"

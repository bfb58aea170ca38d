#!/usr/bin/env bash
# The GPU check, one prepared script, everything under one output folder, in this order: correctness first, the
# longest part last (its times on one H200: results/gpu_check_2026-12-04/):
#   1. the GPU-marked tests: greedy equality and chi-square sampling on CUDA, fp32 and bf16, sdpa, eager and
#      flex_attention (tests/core/test_gpu.py), and cascade attention (tests/core/test_cascade_attention.py: the flash
#      kernel against the pure-torch one, greedy equality through flash-attn, run again once flash-attn installs);
#   2. where a decoding step's time goes under sdpa and flex_attention (scripts/decode_profile.py), and the cost
#      curve of the reference target and of a random-weight Llama-3-8B-shaped model (bf16);
#   3. the tree comparison on the reference models, on the device;
#   4. flash-attn, installed when a wheel is available (tolerated when not: the cascade then runs its pure-torch
#      kernel, and the log says so), and the attention implementations side by side (scripts/attention_timing.py:
#      sdpa, flex_attention and cascade attention; T(N)/T(1) and decoding speedups on the reference target and on
#      the 8B-shaped model).
#
#   bash scripts/gpu_check.sh                        # on a GPU machine: writes runs/gpu_check/<time>/
#   bash scripts/gpu_check.sh --cascade-only         # the cascade tests and part 4 only (a short device session)
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
transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git: a copied working tree)"; } \
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
  "$PY" scripts/decode_profile.py --device cpu --attn sdpa --tokens 8 --out "$OUT" 2>&1 | tee "$OUT/decode_profile.log"
  "$PY" scripts/cost_curve.py --device cpu --model tiny --sizes 1 2 4 --repeats 2 --out "$OUT" 2>&1 | tee "$OUT/cost_curve.log"
  exit 0
fi

# correctness first, then the cheap measurements, the long attention timing last: a device session cut short still
# answers whether the engine is lossless on CUDA
if [ "$CASCADE_ONLY" = 0 ]; then
  "$PY" -m pytest -q -rs tests/core/test_gpu.py 2>&1 | tee "$OUT/tests.log" || true
fi
"$PY" -m pytest -q -rs tests/core/test_cascade_attention.py 2>&1 | tee "$OUT/tests_cascade.log" || true
if [ "$CASCADE_ONLY" = 0 ]; then
  # where an sdpa decoding step's time goes (the first check found it far above its pass) beside flex_attention's
  "$PY" scripts/decode_profile.py --device cuda --attn sdpa --attn flex_attention --out "$OUT" 2>&1 \
    | tee "$OUT/decode_profile.log" || true
  "$PY" scripts/cost_curve.py --device cuda --dtype bfloat16 --model reference --model llama3-8b --out "$OUT" 2>&1 \
    | tee "$OUT/cost_curve.log" || true
  "$PY" scripts/compare_trees.py device=cuda "run_dir=$OUT/compare" logger=none peers=true 2>&1 \
    | tee "$OUT/compare.log" || true
fi
install_flash 2>&1 | tee "$OUT/flash_attn_install.log"
flash_status | tee -a "$OUT/environment.txt"
if "$PY" -c "import flash_attn" 2>/dev/null; then  # the flash kernel's tests skipped above unless it was there
  "$PY" -m pytest -q -rs tests/core/test_cascade_attention.py 2>&1 | tee "$OUT/tests_cascade_flash.log" || true
fi
"$PY" scripts/attention_timing.py --device cuda --dtype bfloat16 --model reference --model llama3-8b \
  --out "$OUT/attention" 2>&1 | tee "$OUT/attention_timing.log" || true
echo "gpu check: outputs in $OUT"

#!/usr/bin/env bash
# Train both reference models (target, then draft) with checkpoints; re-run to resume after an
# interruption. On 2 CPU cores this takes about 1.5-2 hours.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/train_lm.py model=target trainer.compile=true resume=true "$@"
python scripts/train_lm.py model=draft resume=true "$@"

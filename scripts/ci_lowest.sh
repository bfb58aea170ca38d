#!/usr/bin/env bash
# CI's second environment: the focused subset of the tests under the LOWEST supported transformers release
# (setup.cfg's range; the default environment runs the whole suite under the highest). A venv outside the
# repository with --system-site-packages reuses torch and the rest, and holds only transformers at that
# release, and treespec (editable, no dependencies). It is kept between runs (set TREESPEC_CI_VENV to move it).
#
#   bash scripts/ci_lowest.sh              # the subset, about 2 minutes on 2 cores
#   bash scripts/ci_lowest.sh tests/x.py   # other tests under the same release
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOWEST=5.8.1   # SpecForge 0.2's pin; keep equal to setup.cfg's lower bound
VENV=${TREESPEC_CI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/treespec/ci-transformers-$LOWEST}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
if [ "$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)" != "$LOWEST" ]; then
  "$VENV/bin/python" -m pip install -q "transformers==$LOWEST"
fi
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<PYEOF
import pathlib, transformers, treespec
assert transformers.__version__ == "$LOWEST", f"the venv imports transformers {transformers.__version__}"
assert pathlib.Path(treespec.__file__).resolve().parent == pathlib.Path("treespec").resolve(), treespec.__file__
print(f"transformers {transformers.__version__}, treespec from {pathlib.Path(treespec.__file__).parent}")
PYEOF
# greedy equality and plain decoding (generate), losslessness, the KV cache, and two drafters (EAGLE-3, Medusa)
# with the exports and loaders: what touches the API that differs between releases (treespec/compat.py)
TESTS=(tests/core/test_generate.py tests/core/test_cache.py tests/test_lossless.py tests/heads/eagle3/test_eagle3.py
       tests/heads/medusa/test_medusa.py)
if [ $# -gt 0 ]; then TESTS=("$@"); fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q -x -p no:randomly "${TESTS[@]}"

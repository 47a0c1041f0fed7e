#!/usr/bin/env bash
# Python shim tests for CI: venv, model conversion, `pip install ./python_shim`, pytest.
# Measured on the 2-core dev machine with the venv and model already present: ~6 min
# (binding tests 4 s; vLLM integration tests 5 min 10 s). A fresh venv adds ~3 min, conversion ~35 s.
#   KVS_VENV  venv path (default <repo>/.venv), passed to scripts/setup-python.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVS_VENV="${KVS_VENV:-$REPO/.venv}"
PY="$KVS_VENV/bin/python"
start=$(date +%s)
bash scripts/setup-python.sh
[[ -f .cache/smollm2/config.json ]] || "$PY" scripts/convert_model.py
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation ./python_shim
export KVSPARSE_MODEL="$REPO/.cache/smollm2"
cd python_shim/tests   # import the installed package, not the source tree
"$PY" -m pytest -q -rs . "$@"
echo "[python-tests] done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Python shim tests for CI: venv, model conversion, `pip install ./python_shim`, pytest.
# Measured from a fresh clone (git clone; KVS_VENV pointing at an existing complete venv), 2-core dev machine
# shared with other jobs (load average 5-8): 875 s in all = model conversion 60 s, pip install ./python_shim
# (cargo build of the cdylib) + SGLang modules into .cache/sglang-py, pytest 693 s (vLLM integration tests
# 669 s of it), SGLang-classes run 18 s. A fresh venv (scripts/setup-python.sh) adds 166 s with the cores
# free, 388 s with both busy. Since the vLLM backend's rework (issue 19) its pytest step alone measured 824 s
# (load average 3-13; the vLLM tests 784 s of it: 3 new ones, and the five bad configurations in one process).
#   KVS_VENV  venv path (default <repo>/.venv, the venv README's Python section creates: this script
#             reuses it and brings it to scripts/setup-python.sh's pinned versions, which may upgrade or
#             downgrade what is installed there; point KVS_VENV elsewhere to keep that venv as it is)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVS_VENV="${KVS_VENV:-$REPO/.venv}"
PY="$KVS_VENV/bin/python"
start=$(date +%s)
echo "[python-tests] venv $KVS_VENV (scripts/setup-python.sh: seconds when up to date, 3-7 min when fresh)"
bash scripts/setup-python.sh
[[ -f .cache/smollm2/config.json ]] || { echo "[python-tests] converting SmolLM2 (~1 min)"; "$PY" scripts/convert_model.py; }
echo "[python-tests] pip install ./python_shim (cargo build --release --lib)"
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation ./python_shim
export KVSPARSE_MODEL="$REPO/.cache/smollm2"

# SGLang's own attention classes for tests/test_sglang_backend.py. The full `pip install sglang` needs a
# CUDA stack; its attention registry, pools, RadixAttention, ForwardBatch and torch_native backend import on
# CPU with only these few modules, installed --no-deps into a separate directory (git-ignored) so they never
# touch the venv that vLLM runs from. KVS_SGLANG=0 skips it (the SGLang-real test is then reported skipped).
SGL_DIR="$REPO/.cache/sglang-py"
SGL_PKGS=(sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 torchvision==0.29.2)
if [[ "${KVS_SGLANG:-1}" != 0 && "$(cat "$SGL_DIR/.stamp" 2>/dev/null)" != "${SGL_PKGS[*]}" ]]; then
  rm -rf "$SGL_DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$SGL_DIR" "${SGL_PKGS[@]}"
  echo "${SGL_PKGS[*]}" >"$SGL_DIR/.stamp"
fi

cd python_shim/tests   # import the installed package, not the source tree
# -v: one line per test as it ends, so the log says what runs (the vLLM tests take most of the time, a
# few minutes each on 2 cores); --durations: the slowest tests at the end.
echo "[python-tests] pytest ($(( $(date +%s) - start )) s so far; the vLLM tests take ~10-14 min on 2 cores)"
"$PY" -m pytest -v -rs --durations=10 . "$@"
if [[ "${KVS_SGLANG:-1}" != 0 ]]; then
  echo "[python-tests] SGLang backend against SGLang's own classes (PYTHONPATH=$SGL_DIR)"
  KVS_REQUIRE_SGLANG=1 PYTHONPATH="$SGL_DIR" "$PY" -m pytest -v -rs -p no:cacheprovider test_sglang_backend.py -k real_sglang
fi
echo "[python-tests] done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The conformance suite against GPU implementations, in one command on a CUDA machine that has python3 with
# torch (CUDA) and numpy but no internet, no Rust and no kvsparse binding:
#   1. export the suite with a carried kvsparse binary (unless DIR already holds one) and re-check kvsparse's
#      CPU outputs with the numpy-only checker;
#   2. run the targets on CUDA through the Python adapters (loaded by path: torch only);
#   3. optionally (KVS_CUDA_ENGINE=1) kvsparse's own CUDA engine: dense suite and sparse contract.
# Reports go to $OUT (or /tmp/kvs-conformance-out): targets.json (every case, with diagnosis) and the logs.
#
#   bash scripts/conformance-gpu.sh [TARGET ...]      default targets: reference torch-sdpa torch-sdpa-efficient torch-flex
#   KVS_BIN      kvsparse binary (default .device/bin/kvsparse, as scripts/stage-device.sh puts it)   KVS_CASES  suite dir (default /tmp/kvs-cases)
#   KVS_SEED     suite seed (default 20251123)                KVS_FILTER comma-separated case-name filters
#   KVS_BUDGET   seconds per target (default 200)             KVS_DEVICE torch device (default cuda)
#   wheels in .whl/ are installed to $KVS_SITE (default /tmp/site) first (KVS_WHEELS=0 skips that)
# Exit status: non-zero only if the harness itself is wrong (export or numpy check failed, the float64 control
# did not pass every case, a target could not be loaded); a target failing cases is a finding, not an error.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${KVS_BIN:-.device/bin/kvsparse}
CASES=${KVS_CASES:-/tmp/kvs-cases}
RES=${OUT:-/tmp/kvs-conformance-out}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH   # FlashInfer's JIT compiles with nvcc
if [[ "${KVS_WHEELS:-1}" != 0 ]] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${KVS_SITE:-/tmp/site}" .whl/*.whl || exit 1
  export PYTHONPATH=${KVS_SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ ! -f "$CASES/manifest.json" ]]; then
  "$BIN" conformance --export "$CASES" --seed "${KVS_SEED:-20251123}" 2>&1 | tee "$RES/export.log" | tail -3
  [[ ${PIPESTATUS[0]} == 0 ]] || { echo "HARNESS: export failed"; exit 1; }
fi
python3 "$CASES/check.py" "$CASES" > "$RES/check.log" 2>&1 || { tail -5 "$RES/check.log"; echo "HARNESS: numpy check failed"; exit 1; }
tail -2 "$RES/check.log"
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(reference torch-sdpa torch-sdpa-efficient torch-flex)
args=()
for t in "${targets[@]}"; do args+=(--target "$t"); done
DEV=${KVS_DEVICE:-cuda}
python3 scripts/conformance_targets.py "$CASES" --device "$DEV" "${args[@]}" --filter "${KVS_FILTER:-}" \
  --time-budget "${KVS_BUDGET:-200}" --json "$RES/targets.json" 2>&1 | grep -v -i "warn" | tee "$RES/targets.log"
rc=${PIPESTATUS[0]}
if [[ " ${targets[*]} " == *" reference "* ]] && ! grep -Eq "^reference on $DEV: [0-9]+ passed, 0 failed, 0 unsupported$" "$RES/targets.log"; then
  echo "HARNESS: the float64 control did not pass every case"; rc=1
fi
if [[ "${KVS_CUDA_ENGINE:-0}" == 1 ]]; then
  KVS_REQUIRE_CUDA=1 "$BIN" conformance --quick --seed "${KVS_SEED:-20251123}" > "$RES/kvsparse-cuda.log" 2>&1
  echo "kvsparse CUDA engine (exit $?): $(tail -1 "$RES/kvsparse-cuda.log")"
fi
echo "CONFORMANCE-GPU DONE (harness exit $rc); reports in $RES"
exit $rc

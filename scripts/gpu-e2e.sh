#!/usr/bin/env bash
# One GPU run of the end-to-end decode benchmark (issue 15): scripts/gpu_e2e.py over its whole grid (batch 1 at
# 32K and 128K, batch 8 at 32K, batch 32 at 8K; none / kvsparse dense / each GPU policy / SDPA cuDNN; eager and
# CUDA-graph replay; graph == eager checks), in one call under 9 minutes.
# Needs what scripts/stage-shim.sh stages into .device/shim (libkvsparse.so with CUDA, cffi + pycparser wheels);
# run from the repository root with .device carried:
#   bash scripts/gpu-e2e.sh [extra gpu_e2e.py arguments]
# Writes $OUT/gpu_e2e.csv, $OUT/gpu_e2e.log and $OUT/device.txt (OUT defaults to ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SHIM=${SHIM:-.device/shim}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$SHIM"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site KVSPARSE_LIB="$SHIM/libkvsparse.so" PYTHONUNBUFFERED=1
export KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache} KVS_LOG=${KVS_LOG:-1}
# --budget-s: nothing new starts after 420 s (one backend of the largest point takes ~10 s; the default list has
# 8 policies: pass --policy ... to time fewer at every point), so the table is
# printed well before the per-call limit; timeout is the last resort (the CSV is written point by point).
timeout 540 python3 scripts/gpu_e2e.py --budget-s 420 --csv "$OUT/gpu_e2e.csv" "$@" 2>&1 | tee "$OUT/gpu_e2e.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >>"$OUT/device.txt"
echo "gpu-e2e.sh rc=$rc in $(( $(date +%s) - t0 )) s"
exit "$rc"

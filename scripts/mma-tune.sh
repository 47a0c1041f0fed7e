#!/usr/bin/env bash
# Quick GPU pass for the tensor-core kernel: conformance (CPU + CUDA), then the target points under several
# settings and the lane-group (simt) kernel for reference. Logs to $OUT.
# Usage: mma-tune.sh [CONFIG...]   each CONFIG a tag=ENV,ENV e.g. w4s3=KVS_MMA_WARPS=4,KVS_MMA_STAGES=3
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [[ ${SKIP_CONF:-0} != 1 ]]; then
  KVS_LOG=1 "$DIR/bin/kvsparse" conformance >"$OUT/conformance.log" 2>&1; echo "conformance rc=$?"
  grep -E "FAIL|passed|failed" "$OUT/conformance.log" | tail -15
fi
if [[ ${TESTS:-0} == 1 ]]; then
  "$DIR/bin/cuda_tests" --test-threads=1 >"$OUT/cuda-tests.log" 2>&1; echo "cuda_tests rc=$?"; grep -E "test result|FAIL|panicked" "$OUT/cuda-tests.log" | head
fi
: >"$OUT/tune.txt"
for c in "$@"; do
  tag=${c%%=*}; envs=${c#*=}; IFS=, read -ra ev <<<"$envs"
  env "${ev[@]}" "$DIR/bin/kvsparse" bench --device cuda --batch ${BATCHES:-1,32} --ctx ${CTXS:-16384,131072} --heads ${HEADS:-32/8,64/8} >"$OUT/b.log" 2>&1
  echo "== $tag rc=$?" | tee -a "$OUT/tune.txt"; grep -vE "copy|batch" "$OUT/b.log" | tee -a "$OUT/tune.txt"
done

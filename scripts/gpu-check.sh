#!/usr/bin/env bash
# One GPU run: the prebuilt CUDA tests, the conformance matrix on the device, compute-sanitizer
# (memcheck + racecheck, reduced matrix), the kernel-cache reuse check, the decode benchmark and the
# PyTorch SDPA comparison. Expects the binaries staged by scripts/stage-device.sh in $DIR/bin.
# Logs go to $OUT (or ./gpu-out); the last lines printed are a short summary table.
# Usage: gpu-check.sh [all|tests|sanitize|bench]   (default all)
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
what=${1:-all}
export KVS_REQUIRE_CUDA=1
export KVS_KERNEL_CACHE=/tmp/kvs-kernel-cache
rm -rf "$KVS_KERNEL_CACHE"
summary=()
step() { # name, command...
  local name=$1; shift
  local t0=$(date +%s%N)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  summary+=("$(printf '%-18s rc=%-3s %7sms  %s' "$name" "$rc" "$dt" "$(grep -E "$GREP" "$OUT/$name.log" | tail -1 | cut -c1-90)")")
  tail -5 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
if [[ $what == all || $what == tests ]]; then
  GREP='passed|failed|compiled' step conformance1 env KVS_LOG=1 "$DIR/bin/kvsparse" conformance
  GREP='compiled' step conformance2-cache env KVS_LOG=1 "$DIR/bin/kvsparse" conformance --filter mixed-h128
  GREP='test result' step cuda-tests "$DIR/bin/cuda_tests" --test-threads=1 --nocapture
fi
if [[ $what == all || $what == sanitize ]]; then
  GREP='ERROR SUMMARY' step memcheck env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_tests" --test-threads=1
  GREP='ERROR SUMMARY|RACECHECK SUMMARY' step racecheck env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_tests" --test-threads=1 cuda_matches
fi
if [[ $what == all || $what == bench ]]; then
  GREP='copy|target' step bench "$DIR/bin/kvsparse" bench --device cuda --csv "$OUT/bench.csv"
  GREP='done' step sdpa env PYTHONUNBUFFERED=1 python3 "$DIR/sdpa_bench.py" --csv "$OUT/sdpa.csv"
  [[ -f $DIR/compare.py ]] && python3 "$DIR/compare.py" "$OUT/bench.csv" "$OUT/sdpa.csv" | tee "$OUT/compare.txt"
fi
(cd "$OUT" && tar czf logs.tgz --remove-files *.log 2>/dev/null)
echo "==== summary ===="
printf '%s\n' "${summary[@]}"

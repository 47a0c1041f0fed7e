#!/usr/bin/env bash
# RefreshKV on the device (issue 14). Usage: run.sh [tests] [san] [bench] [eval]
# Staging: copy kvsparse, cuda_refresh and cuda_sparse test binaries (stripped) to $DIR/bin and traces/ to $DIR/traces.
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export KVS_REQUIRE_CUDA=1
export KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache}
summary=()
step() { # name, timeout seconds, command...
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  summary+=("$(printf '%-14s rc=%-3s %7sms  %s' "$name" "$rc" "$dt" "$(grep -aE "$GREP" "$OUT/$name.log" | tail -1 | cut -c1-150)")")
}
whats=" $* "
has() { [[ "$whats" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
date -u | tee -a "$OUT/device.txt"
if has tests; then
  GREP='test result|^refresh:' step rf-tests 150 env KVS_QUICK=${RF_QUICK:-0} "$DIR/bin/cuda_refresh" --test-threads=1 --nocapture
  GREP='test result' step refuses 30 "$DIR/bin/cuda_sparse" --test-threads=1 --nocapture cuda_refuses
fi
if has eval; then
  GREP='eval took' step eval-cuda 60 "$DIR/bin/kvsparse" eval --device cuda --traces "$DIR/traces" --policy 'refresh(k=256, stride=5, s=0.85)' --policy 'refresh(k=128, stride=1, s=0.95, pool=3)' --policy 'refresh(k=512, every=4)'
fi
if has san; then
  GREP='ERROR SUMMARY' step memcheck 90 env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_refresh" --test-threads=1
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step racecheck 80 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_refresh" --test-threads=1 decisions
fi
if has bench; then
  GREP='x dense|refresh' step bench 285 "$DIR/bin/kvsparse" bench --device cuda --batch 1,8,32 --ctx 32768,131072 --policy 'refresh(k=2048, stride=1, s=1)' --policy 'refresh(k=2048, every=1000000000)' --policy 'refresh(k=2048, every=5)' --csv "$OUT/refresh.csv"
fi
(cd "$OUT" && tar czf logs.tgz *.log *.csv device.txt 2>/dev/null)
echo "==== summary"
for s in "${summary[@]}"; do echo "$s"; done
for f in "$OUT"/*.log; do echo "==== $(basename $f)"; grep -aE "^refresh |^refresh:|^graph|max_seqs|test result|panicked|FAIL|ERROR SUMMARY|RACECHECK|x dense|RefreshKV|^\|" "$f" | head -80; done

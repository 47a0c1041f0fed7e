#!/usr/bin/env bash
# Is the batch-1 slowdown after heavy points a clock effect? Logs SM clock / power every 50 ms while
# running b1 x 128K and b32 x 128K alternately in one process, then again after a 5 s idle pause.
DIR=$(cd "$(dirname "$0")" && pwd); OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 50 >"$OUT/clocks.csv" 2>&1 &
mon=$!
sleep 1
"$DIR/bin/kvsparse" bench --device cuda --batch 1,32 --ctx 131072 --heads 32/8,32/8,32/8 2>&1 | grep -v batch
sleep 5
"$DIR/bin/kvsparse" bench --device cuda --batch 1 --ctx 16384,131072 --heads 32/8,32/8 2>&1 | grep -v batch
sleep 5
"$DIR/bin/kvsparse" bench --device cuda --batch 32 --ctx 4096,16384 --heads 32/8,32/8 2>&1 | grep -v batch
kill $mon
awk -F, 'NR>1{print $2,$4,$6}' "$OUT/clocks.csv" | sort | uniq -c | sort -rn | head -12

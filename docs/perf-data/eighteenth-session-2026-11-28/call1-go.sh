#!/usr/bin/env bash
# Session 18, call 1: device checks owed for 9b788f2 (Quest scorer tiles of up to 256 pages), 256 forced.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|pages kept|ok$" $OUT/$n.log | head -12; }
export KVS_QUEST_PAGES_PER_CTA=256
t ties 60 $D/cuda_sparse cuda_quest_ties --test-threads=1 --nocapture
t few 90 $D/cuda_sparse cuda_quest_few_rows --test-threads=1 --nocapture
t matrix 120 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture
t other 90 $D/cuda_sparse graph lossless bad_device --test-threads=1 --nocapture
t memcheck 120 env KVS_QUICK=1 compute-sanitizer --tool memcheck $D/cuda_sparse cuda_quest_few_rows --test-threads=1 --nocapture
t racecheck 150 env KVS_QUICK=1 compute-sanitizer --tool racecheck $D/cuda_sparse cuda_quest_few_rows --test-threads=1 --nocapture
unset KVS_QUEST_PAGES_PER_CTA
timeout 100 $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' > $OUT/bench-quest.txt 2>&1
echo "== bench quest"; grep -E "^quest|^dense|batch" $OUT/bench-quest.txt | head -20
timeout 100 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/4) > top_p(p=0.95)' > $OUT/bench-topp.txt 2>&1
echo "== bench topp"; grep -E "top_p|batch" $OUT/bench-topp.txt | head -20

#!/usr/bin/env bash
# Session 18, call 3: top-p's mass histograms with 32-bit shared atomics (carry into the high word) in both
# the tiled kernels and kvs_topp_cluster: bench against main c1bd87b (cluster forced on / off too), tests,
# sanitizers on the cluster kernel.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|agreement:|determinism|graph |error" $OUT/$n.log | head -10; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in base new tiled; do
  case $v in base) cmd="$D/kvsparse-base";; new) cmd="$D/kvsparse";; tiled) cmd="env KVS_TOPP_CLUSTER=0 $D/kvsparse";; esac
  b=1,8,32; [ $v = tiled ] && b=1,8
  timeout 120 $cmd bench --device cuda --batch $b --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-$v.txt 2>&1
  echo "== bench $v"; grep -E "top_p" $OUT/bench-$v.txt
done
t agree 150 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
t agree-tiled 150 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
t memcheck 120 compute-sanitizer --tool memcheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
t synccheck 100 compute-sanitizer --tool synccheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture

#!/usr/bin/env bash
# Session 18, call 5: kvs_topp_cluster at 256 / 512 / 1,024 threads per CTA against the tiled kernels
# (batch 1 and 8), then agreement at 512 and 1,024, memcheck and racecheck at 1,024.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|agreement:|error" $OUT/$n.log | head -6; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in tiled 256 512 1024 tiled2; do
  case $v in tiled*) e="KVS_TOPP_CLUSTER=0";; *) e="KVS_TOPP_CLUSTER_THREADS=$v";; esac
  b=1; [ $v = 1024 ] && b=1,8
  env $e timeout 100 $D/kvsparse bench --device cuda --batch $b --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-$v.txt 2>&1
  echo "== bench $v"; grep -E "top_p" $OUT/bench-$v.txt
done
t agree1024 150 env KVS_TOPP_CLUSTER_THREADS=1024 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
t agree512 150 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
t memcheck 80 env KVS_TOPP_CLUSTER_THREADS=1024 compute-sanitizer --tool memcheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture

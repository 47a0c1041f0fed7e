#!/usr/bin/env bash
# Session 18, call 2: top-p's steps after the estimate in one cluster launch (kvs_topp_cluster) at small
# batch: agreement, ties, determinism, graph replay, the sparse matrix; bench against main c1bd87b.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|agreement:|determinism|graph |error" $OUT/$n.log | head -10; }
P='quest(budget=L/4) > top_p(p=0.95)'
# bench first (the kernel cache warm for the tests after)
for v in base new; do
  cmd=$D/kvsparse; [ $v = base ] && cmd=$D/kvsparse-base
  timeout 120 $cmd bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-$v.txt 2>&1
  echo "== bench $v"; grep -E "top_p" $OUT/bench-$v.txt
done
t ties 60 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
t agree 150 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
t determ 100 env KVS_TOPP_CLUSTER=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
t graph 80 env KVS_TOPP_CLUSTER=1 $D/cuda_top_p cuda_top_p_graph --test-threads=1 --nocapture
t matrix 100 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture

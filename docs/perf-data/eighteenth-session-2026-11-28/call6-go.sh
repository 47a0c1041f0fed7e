#!/usr/bin/env bash
# Session 18, call 6: the committed kvs_topp_cluster (512 threads): bench against main c1bd87b, racecheck,
# graph replay and determinism with the cluster forced, the sparse matrix.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|determinism|graph |error" $OUT/$n.log | head -6; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in base new; do
  cmd=$D/kvsparse; [ $v = base ] && cmd=$D/kvsparse-base
  timeout 90 $cmd bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-$v.txt 2>&1
  echo "== bench $v"; grep -E "top_p|policy" $OUT/bench-$v.txt
done
t racecheck 100 compute-sanitizer --tool racecheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
t graph 60 env KVS_TOPP_CLUSTER=1 $D/cuda_top_p cuda_top_p_graph --test-threads=1 --nocapture
t determ 80 env KVS_TOPP_CLUSTER=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
t matrix 60 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture

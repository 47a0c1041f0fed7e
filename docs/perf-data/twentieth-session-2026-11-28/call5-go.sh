#!/usr/bin/env bash
# Session 20, call 5: top-p's weighted histograms (bin_add) by three 32-bit warp reductions over each bin's
# lanes instead of a 64-bit butterfly per bin: agreement on both paths (cluster default, tiled forced), ties,
# determinism, graph, the sparse quick matrix, memcheck; select time against c87c002 (kvsparse-old).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|determinism|agreement:|rror" $OUT/$n.log | head -6; }
P='quest(budget=L/4) > top_p(p=0.95)'
timeout 60 $D/kvsparse bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$P" > $OUT/warm.txt 2>&1; echo "== warm rc=$?"
( t agree 140 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t agree-tiled 140 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t ties 60 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t ties-tiled 60 env KVS_TOPP_CLUSTER=0 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t determ 100 env KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
  t graph 40 $D/cuda_top_p cuda_top_p_graph --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t matrixq 140 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture ) > $OUT/par-e.txt 2>&1 &
( t memcheck 140 env KVS_TOPP_CLUSTER=0 compute-sanitizer --tool memcheck --kernel-name kns=kvs_topp $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
wait
cat $OUT/par-*.txt
grep -a "^sparse" $OUT/matrixq.log | grep top_p | grep -vc "decisions same"
b() { local n=$1; shift; local t0=$SECONDS; timeout 100 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "top_p|rror" $OUT/bench-$n.txt; }
b new1 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"
b old1 $D/kvsparse-old bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"
b new2 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"
cd $OUT && tar czf all.tgz *.txt *.log && rm -f *.txt *.log; ls $OUT

#!/usr/bin/env bash
# Session 20, call 6: top-p's bin_add with the butterfly for up to 8 / 32 distinct bins per warp (else each
# lane's own shared atomics) against 4 (main): select time alternating; agreement of both variants (tiled path).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|test result|agreement:|rror" $OUT/$n.log | head -4; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in l4 l8 l32; do timeout 60 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$P" > /dev/null 2>&1; done
b() { local n=$1; shift; timeout 60 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$?"; grep -aE "top_p|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in l4 l8 l32; do b $v-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"; done; done
( t agree-l8 130 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p-l8 cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t agree-l32 130 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p-l32 cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t agree-l32c 130 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p-l32 cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t ties-l32 60 env KVS_TOPP_CLUSTER=0 $D/cuda_top_p-l32 cuda_top_p_ties --test-threads=1 --nocapture
  t ties-l8 60 env KVS_TOPP_CLUSTER=0 $D/cuda_top_p-l8 cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
wait
cat $OUT/par-*.txt
cd $OUT && tar czf all.tgz *.txt *.log && rm -f *.txt *.log; ls $OUT

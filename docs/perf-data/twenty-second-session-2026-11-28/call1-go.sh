#!/usr/bin/env bash
# Session 22, call 1 (session 21 call 9 plus memcheck, 128K twice): the time average in two shapes by the launch's columns (i) against main 5b24345 (e):
# checks (both shapes forced), the bench at 32K and 128K x batch 1, 8.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|test result|compared|rror" $OUT/$n.log | head -6; }
PP='predictor(budget=L/32); max_seqs=32'
( timeout 60 $D/kvsparse-i bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm i rc=$?" ) &
( timeout 60 $D/kvsparse-e bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm e rc=$?" ) &
( t decide-wide 80 env KVS_QUICK=1 KVS_PRED_AVERAGE=wide $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t decide-narrow 80 env KVS_QUICK=1 KVS_PRED_AVERAGE=narrow $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t memcheck-wide 120 env KVS_QUICK=1 KVS_PRED_AVERAGE=wide compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_average $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 ) > $OUT/par-d.txt 2>&1 &
wait
cat $OUT/par-*.txt
k=0; b() { local n=$1-$k; k=$((k+1)); shift; timeout 40 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$?"; grep -aE "AttentionPredictor|rror" $OUT/bench-$n.txt; }
for c in 131072 32768 131072; do for v in i e; do b $v-$c $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx $c --heads 32/8 --policy "$PP"; done; done
cd $OUT && tar czf all.tgz *.txt *.log && rm -f *.txt *.log; ls $OUT

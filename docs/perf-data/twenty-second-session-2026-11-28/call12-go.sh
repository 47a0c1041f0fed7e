#!/usr/bin/env bash
# Session 22, call 12: kvs_pred_logits over one wave of two per SM while that leaves >= 16 CTAs per row (g)
# against main (f): quick decisions, graph, the bench at 32K / 128K x batch 1, 8, 32 alternating.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
for v in g f; do ( timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?" ) & done
( t pr-decide 120 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
wait
cat $OUT/par-*.txt
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|rror" $OUT/bench-$n.txt | cut -c1-200; }
for v in g f; do b $v-128k $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$PP"; done
for v in g f; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$PP"; done
b g-128k-r2 $D/kvsparse-g bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"
cd $OUT && tar czf all.tgz *.txt *.log && rm -rf *.txt *.log; ls $OUT

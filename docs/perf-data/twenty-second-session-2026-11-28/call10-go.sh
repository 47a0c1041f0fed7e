#!/usr/bin/env bash
# Session 22, call 10: the final main (f, the step-context refactor): quick decisions, graph, slot map, bench.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
( timeout 90 $D/kvsparse-f bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm rc=$?" ) &
( t pr-decide 120 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
wait
cat $OUT/par-*.txt
timeout 120 $D/kvsparse-f bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/bench-f-128k.txt 2>&1; echo "== bench rc=$?"; grep -aE "AttentionPredictor|rror" $OUT/bench-f-128k.txt
cd $OUT && tar czf all.tgz *.txt *.log && rm -rf *.txt *.log; ls $OUT

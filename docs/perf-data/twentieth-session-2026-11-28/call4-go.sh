#!/usr/bin/env bash
# Session 20, call 4 (main c87c002 + perf-data): Quest's 128-page scorer tiles under test (forced on the
# test geometries); the top-k's CTA form at batch 1 against the cluster; the predictor and Quest per layer
# and end to end (scripts/gpu_e2e.py, graph, beside dense and SDPA in the same run).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
( t decide128 150 env KVS_QUEST_PAGES_PER_CTA=128 KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t ties128 150 env KVS_QUEST_PAGES_PER_CTA=128 $D/cuda_sparse cuda_quest_ties --test-threads=1 --nocapture
  t few128 100 env KVS_QUEST_PAGES_PER_CTA=128 $D/cuda_sparse cuda_quest_few_rows --test-threads=1 --nocapture
  t graph 60 $D/cuda_sparse cuda_sparse_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t pred 150 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
wait
cat $OUT/par-*.txt
b() { local n=$1; shift; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$?"; grep -aE "^quest|^predictor|AttentionPredictor|parts|rror" $OUT/bench-$n.txt; }
b quest-default $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)'
b quest-topk-cta env KVS_QUEST_TOPK=cta $D/kvsparse bench --device cuda --batch 1 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)'
b pred $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32'
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/shim/whl/*.whl
PYTHONPATH=/tmp/site KVSPARSE_LIB=.device/shim/libkvsparse.so PYTHONUNBUFFERED=1 KVS_KERNEL_CACHE=/tmp/kvs-e2e timeout 300 python3 scripts/gpu_e2e.py --budget-s 240 --csv $OUT/gpu_e2e.csv --grid 1x32768,1x131072,8x32768 --policy 'quest(budget=L/16)' --policy 'predictor(budget=L/32)' > $OUT/gpu_e2e.log 2>&1
echo "== e2e rc=$?"; grep -aE "^[18] |^B |graph replay|total" $OUT/gpu_e2e.log
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

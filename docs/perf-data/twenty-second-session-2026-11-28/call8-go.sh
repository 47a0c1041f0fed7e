#!/usr/bin/env bash
# Session 22, call 8: main's final predictor (m: history rows from the attention, kvs_pred_logits a plain launch):
# quick decisions, graph, slot map, memcheck; gpu_e2e with dense, Quest, SnapKV, RefreshKV, the predictor in one
# call; the bench at 32K / 128K x batch 1, 8, 32.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
( timeout 90 $D/kvsparse-m bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm rc=$?" ) &
( t pr-decide 120 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t pr-memcheck 200 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
wait
cat $OUT/par-*.txt
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "^predictor|AttentionPredictor|predictor parts|rror" $OUT/bench-$n.txt | cut -c1-200; }
b m-128k $D/kvsparse-m bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$PP"
b m-32k $D/kvsparse-m bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$PP"
python3 -m pip install -q --no-index --no-deps --target /tmp/site $D/shim/whl/*.whl
PYTHONPATH=/tmp/site KVSPARSE_LIB=$D/shim/libkvsparse.so PYTHONUNBUFFERED=1 KVS_KERNEL_CACHE=/tmp/kvs-e2e timeout 400 python3 scripts/gpu_e2e.py --budget-s 360 --csv $OUT/gpu_e2e.csv --grid 1x32768,1x131072,8x32768 --policy 'quest(budget=L/16)' --policy 'snapkv(budget=L/16)' --policy 'refresh(k=L/16, every=5)' --policy 'predictor(budget=L/32)' > $OUT/gpu_e2e.log 2>&1
echo "== e2e rc=$?"; grep -aE "^[18] |^B |graph replay|total" $OUT/gpu_e2e.log
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -rf *.txt *.log *.csv; ls $OUT

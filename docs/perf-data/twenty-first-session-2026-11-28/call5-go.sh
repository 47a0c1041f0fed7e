#!/usr/bin/env bash
# Session 21, call 5: kvs_pred_conv's grid from the steady items (e) against 9 CTAs per SM (d); checks; the
# predictor, Quest and ART rows for perf.md from e (= main after the session); end to end (graph).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
A='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)'
for v in d e; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" --policy "$A" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t pr-decide 200 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum
for v in d e; do for p in 1x32768 1x131072 8x32768 8x131072; do
  timeout 100 ncu --clock-control none --kernel-name kvs_pred_conv --launch-skip 30 --launch-count 4 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch ${p%x*} --ctx ${p#*x} --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$p.csv 2>&1
  echo "== ncu conv $v $p: $(grep -a gpu__time_duration $OUT/ncu-$v-$p.csv | awk -F'","' '{printf "%s ", $15}')"
done; done
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|quest|rror" $OUT/bench-$n.txt; }
b e-pred-128k $D/kvsparse-e bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$PP"
b e-pred-32k $D/kvsparse-e bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$PP"
b d-pred-128k $D/kvsparse-d bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"
b e-art $D/kvsparse-e bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' --policy "$A"
python3 -m pip install -q --no-index --no-deps --target /tmp/site $D/shim/whl/*.whl
PYTHONPATH=/tmp/site KVSPARSE_LIB=$D/shim/libkvsparse.so PYTHONUNBUFFERED=1 KVS_KERNEL_CACHE=/tmp/kvs-e2e timeout 300 python3 scripts/gpu_e2e.py --budget-s 240 --csv $OUT/gpu_e2e.csv --grid 1x32768,1x131072,8x32768 --policy 'quest(budget=L/16)' --policy 'predictor(budget=L/32)' > $OUT/gpu_e2e.log 2>&1
echo "== e2e rc=$?"; grep -aE "^[18] |^B |graph replay|total" $OUT/gpu_e2e.log
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

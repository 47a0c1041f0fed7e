#!/usr/bin/env bash
# Session 22, call 4: (k) = the history rows of PRED / NOHIST rows from the step's attention: the full decisions
# matrix, racecheck of the selection, gpu_e2e with every issue-35 policy beside dense and Quest in one call, the
# bench at 32K / 128K x batch 1, 8, 32 against main (e), ncu at 32 x 128K.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
for v in k e; do ( timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?" ) & done
( t pr-decide-full 250 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-racecheck-select 200 compute-sanitizer --tool racecheck --kernel-name kns=kvs_pred_select $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-memcheck-graph 200 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
wait
cat $OUT/par-*.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site $D/shim/whl/*.whl
PYTHONPATH=/tmp/site KVSPARSE_LIB=$D/shim/libkvsparse.so PYTHONUNBUFFERED=1 KVS_KERNEL_CACHE=/tmp/kvs-e2e timeout 400 python3 scripts/gpu_e2e.py --budget-s 360 --csv $OUT/gpu_e2e.csv --grid 1x32768,1x131072,8x32768 --policy 'quest(budget=L/16)' --policy 'snapkv(budget=L/16)' --policy 'refresh(k=L/16, every=5)' --policy 'predictor(budget=L/32)' > $OUT/gpu_e2e.log 2>&1
echo "== e2e rc=$?"; grep -aE "^[18] |^B |graph replay|total" $OUT/gpu_e2e.log
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|predictor parts|rror" $OUT/bench-$n.txt; }
for v in k e; do b $v-128k $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$PP"; done
for v in k e; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$PP"; done
for v in k e; do b $v-128k-32-r2 $D/kvsparse-$v bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "$PP"; done
M=gpu__time_duration.sum
for v in e k; do
  timeout 150 ncu --clock-control none --kernel-name regex:"kvs_pred_(logits|weights|finish|select)|kvs_attn_mma" --launch-skip 200 --launch-count 40 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$v-32.csv 2>&1
  echo "== ncu $v rc=$?"; grep -a gpu__time_duration $OUT/ncu-$v-32.csv | awk -F'","' '{print $5, $15}' | sed 's/"//g' | awk '{k=$1; s[k]=s[k]" "$NF} END {for (k in s) print k, s[k]}'
done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -rf *.txt *.log *.csv; ls $OUT

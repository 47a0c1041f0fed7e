#!/usr/bin/env bash
# Session 22, call 3: (k) = (j) with the ring rows zeroed by the selection, kvs_pred_logits skipping PRED / NOHIST rows at once, the CALIB weights path as main's;
# against main (e) and call 2's (j): checks, eval cuda vs cpu, ncu, bench.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
for v in k j e; do ( timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?" ) & done
( t pr-decide 120 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t pr-memcheck 200 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t attn-memcheck 200 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_attn $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-racecheck 150 compute-sanitizer --tool racecheck --kernel-name kns=kvs_pred_weights $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
EV="--policy predictor(budget=256) --policy predictor(budget=512) --policy predictor(budget=1024) --policy predictor(budget=2048) --policy predictor(budget=256,calib=3)"
( t eval-cuda 200 $D/kvsparse-k eval --device cuda --dtype bf16 $EV
  t eval-cpu 200 $D/kvsparse-k eval --dtype bf16 $EV ) > $OUT/par-e.txt 2>&1 &
wait
cat $OUT/par-*.txt
grep -a "predictor(" $OUT/eval-cuda.log $OUT/eval-cpu.log
M=gpu__time_duration.sum
for v in e k; do
  timeout 100 ncu --clock-control none --kernel-name regex:"kvs_pred|kvs_attn_mma" --launch-skip 400 --launch-count 60 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$v-1.csv 2>&1
  echo "== ncu $v rc=$?"; grep -a gpu__time_duration $OUT/ncu-$v-1.csv | awk -F'","' '{print $5, $15}' | sed 's/(.*)//' | awk '{s[$1]+=$NF; n[$1]++} END {for (k in s) printf "%s n=%d mean=%.1f\n", k, n[k], s[k]/n[k]/1000}'
done
b() { local n=$1; shift; local t0=$SECONDS; timeout 60 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|predictor parts|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in k j e; do b $v-128k-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done; done
for v in k e; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768 --heads 32/8 --policy "$PP"; done
for v in k e; do b $v-128k-32 $D/kvsparse-$v bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "$PP"; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -rf *.txt *.log *.csv; ls $OUT

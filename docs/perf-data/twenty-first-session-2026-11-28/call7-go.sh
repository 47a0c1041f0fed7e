#!/usr/bin/env bash
# Session 21, call 7: the history-row launches (kvs_pred_logits, kvs_pred_weights) over one wave of 2 CTAs
# per SM (f) or 4 (g) instead of 1,024 CTAs (e); checks of f; times.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
for v in e f g; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t pr-decide 200 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t pr-memcheck 200 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_ $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum
for v in e f g; do for p in 1x131072 8x131072; do
  timeout 100 ncu --clock-control none --kernel-name regex:'kvs_pred_(logits|weights)' --launch-skip 20 --launch-count 10 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch ${p%x*} --ctx ${p#*x} --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$p.csv 2>&1
  echo "== ncu $v $p: $(grep -a gpu__time_duration $OUT/ncu-$v-$p.csv | awk -F'","' '{printf "%s %s | ", $5, $15}')"
done; done
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in e f g; do b $v-128k-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done; done
for v in e f g; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$PP"; done
b f-128k-32 $D/kvsparse-f bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "$PP"
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

#!/usr/bin/env bash
# Session 21, call 3: kvs_pred_conv without empty items and with its MMA loop unrolled; kvs_art_priority as a
# rank count over many CTAs per row. Checks (predictor decisions, graph, memcheck, racecheck; ART's tile stops,
# lossless, graph, decisions, memcheck) and times against main (a) in the same call (d = new).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|agreement:|rror|tokens apart" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
A='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)'
for v in a d; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" --policy "$A" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t pr-decide 220 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t pr-slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture
  t art-stop 120 $D/cuda_sparse cuda_art_stops --test-threads=1 --nocapture
  t lossless 120 $D/cuda_sparse cuda_lossless --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t pr-memcheck 220 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_conv $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t pr-racecheck 220 compute-sanitizer --tool racecheck --kernel-name kns=kvs_pred_conv $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t art-memcheck 220 compute-sanitizer --tool memcheck --kernel-name kns=kvs_art_priority $D/cuda_sparse cuda_art_stops --test-threads=1 --nocapture
  t art-racecheck 120 compute-sanitizer --tool racecheck --kernel-name kns=kvs_art_priority $D/cuda_sparse cuda_art_stops --test-threads=1 --nocapture ) > $OUT/par-e.txt 2>&1 &
( t sp-graph 200 $D/cuda_sparse cuda_sparse_decode_step_graph --test-threads=1 --nocapture
  t sp-decide 220 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum
for v in a d; do for bb in 1 8; do
  timeout 100 ncu --clock-control none --kernel-name kvs_pred_conv --launch-skip 30 --launch-count 6 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch $bb --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$bb.csv 2>&1
  echo "== ncu conv $v batch $bb: $(grep -a gpu__time_duration $OUT/ncu-$v-$bb.csv | awk -F'","' '{printf "%s ", $15}')"
done
  timeout 100 ncu --clock-control none --kernel-name kvs_art_priority --launch-skip 100 --launch-count 6 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$A" > $OUT/ncu-art-$v.csv 2>&1
  echo "== ncu art priority $v: $(grep -a gpu__time_duration $OUT/ncu-art-$v.csv | awk -F'","' '{printf "%s ", $15}')"
done
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|quest|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in a d; do b $v-128k-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done; done
for v in a d; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768 --heads 32/8 --policy "$PP"; done
for v in a d; do b art-$v $D/kvsparse-$v bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' --policy "$A"; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

#!/usr/bin/env bash
# Session 21, call 4: racecheck of kvs_art_priority, main (a) against the rank count (9), on the bench and the
# test; kvs_pred_conv's CTAs per SM: 3 / 6 / 9 (new default) / 12.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|Internal|test result|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
A='quest(budget=512) > art(tau=1e-3, phi=1e-2, patience=2)'
for v in a 9; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" --policy "$A" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t rc-a 150 compute-sanitizer --tool racecheck --kernel-name kns=kvs_art_priority $D/kvsparse-a bench --device cuda --batch 1,4 --ctx 4096 --heads 32/8 --policy "$A" ) > $OUT/par-a.txt 2>&1 &
( t rc-9 150 compute-sanitizer --tool racecheck --kernel-name kns=kvs_art_priority $D/kvsparse-9 bench --device cuda --batch 1,4 --ctx 4096 --heads 32/8 --policy "$A" ) > $OUT/par-b.txt 2>&1 &
( t rc-test-quest 150 compute-sanitizer --tool racecheck --kernel-name kns=kvs_quest $D/cuda_sparse cuda_art_stops --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t rc-test-noflt 200 compute-sanitizer --tool racecheck --kernel-name kns=kvs_art_priority --racecheck-detect-level error $D/cuda_sparse cuda_art_stops --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum
for v in 3 6 9 12; do for bb in 1 8; do
  timeout 100 ncu --clock-control none --kernel-name kvs_pred_conv --launch-skip 30 --launch-count 6 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch $bb --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$bb.csv 2>&1
  echo "== ncu conv $v batch $bb: $(grep -a gpu__time_duration $OUT/ncu-$v-$bb.csv | awk -F'","' '{printf "%s ", $15}')"
done; done
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|rror" $OUT/bench-$n.txt; }
for v in 3 6 9 12; do b $v-128k $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done
for v in 3 6 9 12; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768 --heads 32/8 --policy "$PP"; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

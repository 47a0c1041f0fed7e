#!/usr/bin/env bash
# Session 20, call 2: kvs_pred_select_cluster with its chunk range fixed (the empty CTAs after a partial
# last chunk took it again); its checks; kvs_pred_average with 16 rows in flight against 8 (kvsparse-avg8);
# the cluster / CTA choice at batch 1, 8, 32.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|agreement:|rror|tokens apart" $OUT/$n.log | head -8; }
P='predictor(budget=L/32); max_seqs=32'
for b in kvsparse kvsparse-avg8; do timeout 60 $D/$b bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$P" > $OUT/warm-$b.txt 2>&1; echo "== warm $b rc=$?"; done
( t decide 220 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t decide-cta 150 env KVS_PRED_SELECT=cta KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture
  t graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t memcheck 220 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_ $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t racecheck 220 compute-sanitizer --tool racecheck --kernel-name kns=kvs_pred_select_cluster $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t tp-memcheck 200 compute-sanitizer --tool memcheck --kernel-name kns=kvs_topp_estimate $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
wait
cat $OUT/par-*.txt
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|rror" $OUT/bench-$n.txt; }
b new-131072 $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P"
b avg8-131072 $D/kvsparse-avg8 bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P"
b cta-131072 env KVS_PRED_SELECT=cta $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P"
b cl32-131072 env KVS_PRED_SELECT=cluster $D/kvsparse bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "$P"
b new-32768 $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$P"
b cta-32768 env KVS_PRED_SELECT=cta $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768 --heads 32/8 --policy "$P"
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
for v in kvsparse kvsparse-avg8; do for bb in 1 8; do
  timeout 60 ncu --clock-control none --kernel-name regex:'kvs_pred_(average|select)' --launch-skip 20 --launch-count 4 --metrics $M --csv $D/$v bench --device cuda --batch $bb --ctx 131072 --heads 32/8 --policy "$P" > $OUT/ncu-$v-$bb.csv 2>&1
  echo "== ncu $v batch $bb"; grep -a "gpu__time_duration\|dram__" $OUT/ncu-$v-$bb.csv | awk -F'","' '{print $5, $13, $15}' | head -8
done; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

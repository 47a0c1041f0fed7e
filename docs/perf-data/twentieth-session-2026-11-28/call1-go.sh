#!/usr/bin/env bash
# Session 20, call 1: the predictor's selection on thread-block clusters (kvs_pred_select_cluster): its
# decisions (cluster default and CTA forced), graph, slot map, memcheck and racecheck; the checks owed on
# the top-p estimate helpers (eccadb8); the bench at 128K, cluster (default) against CTA in the same call.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|agreement:|rror|tokens apart" $OUT/$n.log | head -8; }
# Warm the kernel cache once (NVRTC) before the parallel groups.
timeout 60 $D/kvsparse bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32' > $OUT/warm.txt 2>&1; echo "== warm rc=$?"
( t decide 200 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t decide-cta 150 env KVS_PRED_SELECT=cta KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture
  t graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture
  t slotmap 60 $D/cuda_predictor cuda_predictor_full_slot_map --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t memcheck 200 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name regex:kvs_pred_select $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t racecheck 200 env KVS_QUICK=1 compute-sanitizer --tool racecheck --kernel-name regex:kvs_pred_select_cluster $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t tp-agree 150 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
  t tp-ties 60 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-e.txt 2>&1 &
( t tp-memcheck 150 compute-sanitizer --tool memcheck --kernel-name regex:kvs_topp_estimate $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
wait
cat $OUT/par-*.txt
P='predictor(budget=L/32); max_seqs=32'
for v in cluster cta; do
  env KVS_PRED_SELECT=$v timeout 110 $D/kvsparse bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$P" > $OUT/bench-$v-131072.txt 2>&1
  echo "== bench $v 131072 rc=$?"; grep -aE "predictor|rror" $OUT/bench-$v-131072.txt
done
M=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
for v in cluster cta; do
  env KVS_PRED_SELECT=$v timeout 60 ncu --clock-control none --kernel-name regex:'kvs_pred_select' --launch-skip 20 --launch-count 2 --metrics $M --csv $D/kvsparse bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$P" > $OUT/ncu-$v.csv 2>&1
  echo "== ncu $v"; grep -a "gpu__time_duration\|inst_exec" $OUT/ncu-$v.csv | awk -F'","' '{print $5, $13, $15}' | head -4
done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

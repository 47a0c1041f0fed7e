#!/usr/bin/env bash
# Session 21, call 1: the top-p checks owed on f4cdd55 (bin_add by each lane's own atomics): agreement on both
# paths, ties, determinism, graph, memcheck; ncu of the predictor's CNN (kvs_pred_conv) at 1 x 128K and 8 x 128K;
# ART behind Quest against Quest alone, with and without the detector.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|agreement:|rror|tokens apart" $OUT/$n.log | head -8; }
PT='quest(budget=L/4) > top_p(p=0.95)'
timeout 90 $D/kvsparse bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PT" --policy 'predictor(budget=L/32); max_seqs=32' --policy 'quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)' > $OUT/warm.txt 2>&1; echo "== warm rc=$?"
( t tp-agree-cl 200 env KVS_TOPP_CLUSTER=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t tp-agree-tiled 200 env KVS_TOPP_CLUSTER=0 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t tp-ties-cl 60 env KVS_TOPP_CLUSTER=1 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t tp-ties-tiled 60 env KVS_TOPP_CLUSTER=0 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t tp-det 60 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
  t tp-graph 60 $D/cuda_top_p cuda_top_p_graph_replay --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t tp-memcheck-cl 200 env KVS_TOPP_CLUSTER=1 KVS_QUICK=1 KVS_TOPP_SMALL=1 compute-sanitizer --tool memcheck --kernel-name regex:kvs_topp $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t tp-memcheck-tiled 200 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 compute-sanitizer --tool memcheck --kernel-name regex:kvs_topp $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-e.txt 2>&1 &
( t tp-racecheck 200 env KVS_TOPP_CLUSTER=0 compute-sanitizer --tool racecheck --kernel-name regex:kvs_topp_pass $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
wait
cat $OUT/par-*.txt
PP='predictor(budget=L/32); max_seqs=32'
for bb in 1 8; do
  timeout 120 ncu --clock-control none --kernel-name kvs_pred_conv --launch-skip 30 --launch-count 1 --set full $D/kvsparse bench --device cuda --batch $bb --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-conv-$bb.txt 2>&1
  echo "== ncu conv batch $bb rc=$?"; grep -aE "^ +(Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit)" $OUT/ncu-conv-$bb.txt | head -12
done
M=gpu__time_duration.sum
timeout 100 ncu --clock-control none --kernel-name regex:'kvs_pred_' --launch-skip 40 --launch-count 24 --metrics $M --csv $D/kvsparse bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-pred-1.csv 2>&1
echo "== ncu pred kernels batch 1"; grep -a "gpu__time_duration" $OUT/ncu-pred-1.csv | awk -F'","' '{print $5, $15}' | head -24
A='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)'
AI='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=inf)'
AR='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5, order=recent)'
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "quest|art|rror" $OUT/bench-$n.txt; }
b art $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' --policy "$A" --policy "$AI" --policy "$AR"
b art-noprobe env KVS_ART_NOPROBE=1 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$AI"
timeout 100 ncu --clock-control none --kernel-name regex:'kvs_|attn' --launch-skip 200 --launch-count 30 --metrics $M --csv $D/kvsparse bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$A" > $OUT/ncu-art-1.csv 2>&1
echo "== ncu art batch 1"; grep -a "gpu__time_duration" $OUT/ncu-art-1.csv | awk -F'","' '{print $5, $15}' | head -30
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

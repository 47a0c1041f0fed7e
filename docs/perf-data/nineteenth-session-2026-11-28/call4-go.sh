#!/usr/bin/env bash
# Session 19, call 4: the tensor-core estimate v2 (nibble pairs by LOP3, power-of-two scales, 32 candidates
# per warp round) against v1 (6940d80) in one call; its checks (agreement, ties, determinism, graph, the
# sparse matrix, memcheck); ncu of the estimate.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|determinism|agreement:|error|tokens apart" $OUT/$n.log | head -8; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in v1 v2 v1b v2b; do
  cmd=$D/kvsparse; case $v in v1*) cmd=$D/kvsparse-v1;; esac
  timeout 100 $cmd bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-topp-$v.txt 2>&1
  echo "== topp $v"; grep -E "top_p|rror" $OUT/bench-topp-$v.txt
done
( t agree 200 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
  t determ 120 env KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t ties 100 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t graph 60 $D/cuda_top_p cuda_top_p_graph --test-threads=1 --nocapture
  t matrixq 150 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t memcheck 100 compute-sanitizer --tool memcheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
wait
cat $OUT/par-a.txt $OUT/par-b.txt $OUT/par-c.txt
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
for b in 1 8; do
  timeout 60 ncu --clock-control none --kernel-name regex:'kvs_topp_estimate' --launch-skip 3 --launch-count 2 --metrics $M --csv $D/kvsparse bench --device cuda --batch $b --ctx 131072 --heads 32/8 --policy "$P" > $OUT/ncu-v2-$b.csv 2>&1
  echo "== ncu v2 batch $b"; grep -a "gpu__time_duration\|throughput\|inst_exec" $OUT/ncu-v2-$b.csv | awk -F'","' '{print $5, $13, $15}' | head -4
done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

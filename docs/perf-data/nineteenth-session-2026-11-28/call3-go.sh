#!/usr/bin/env bash
# Session 19, call 3: top-p's INT4 estimate on tensor cores (kvs_topp_estimate_mma) against the scalar
# kernel (KVS_TOPP_SCALAR_ESTIMATE=1) in one call; agreement (top-p suite, sparse matrix, FP8 policies),
# ties, determinism, graph; memcheck and racecheck; ncu of the estimate.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|determinism|agreement:|error|tokens apart" $OUT/$n.log | head -8; }
P='quest(budget=L/4) > top_p(p=0.95)'
for v in mma scalar mma2; do
  e="X=1"; [ $v = scalar ] && e="KVS_TOPP_SCALAR_ESTIMATE=1"
  env $e timeout 100 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-topp-$v.txt 2>&1
  echo "== topp $v ($e)"; grep -E "top_p|rror" $OUT/bench-topp-$v.txt
done
( t agree 200 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture
  t ties 100 $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t determ 120 env KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
  t graph 60 $D/cuda_top_p cuda_top_p_graph --test-threads=1 --nocapture ) > $OUT/par-topp.txt 2>&1 &
( t matrixq 150 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture
  t fp8 200 $D/cuda_fp8 cuda_fp8_policies_match_the_cpu_engine --exact --test-threads=1 --nocapture ) > $OUT/par-sparse.txt 2>&1 &
( t memcheck 100 compute-sanitizer --tool memcheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture
  t racecheck 250 compute-sanitizer --tool racecheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-san.txt 2>&1 &
wait
cat $OUT/par-topp.txt $OUT/par-sparse.txt $OUT/par-san.txt
grep -a "^sparse" $OUT/matrixq.log | grep top_p | head -20
M=gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
for v in mma scalar; do
  e="X=1"; [ $v = scalar ] && e="KVS_TOPP_SCALAR_ESTIMATE=1"
  for b in 1 8; do
    env $e timeout 60 ncu --clock-control none --kernel-name regex:'kvs_topp_estimate' --launch-skip 3 --launch-count 3 --metrics $M --csv $D/kvsparse bench --device cuda --batch $b --ctx 131072 --heads 32/8 --policy "$P" > $OUT/ncu-$v-$b.csv 2>&1
    echo "== ncu $v batch $b"; grep -a "gpu__time_duration\|throughput" $OUT/ncu-$v-$b.csv | awk -F'","' '{print $5, $13, $15}' | head -6
  done
done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

#!/usr/bin/env bash
# Session 21, call 8: kvs_pred_average with 32 rows' loads in flight per thread and 128 columns per CTA (h)
# against 8 rows and 256 (e = main 5b24345): checks of h; ncu; the bench, alternating.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|compared|rror" $OUT/$n.log | head -8; }
PP='predictor(budget=L/32); max_seqs=32'
for v in e h; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t pr-decide 150 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture
  t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t pr-memcheck 150 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_average $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
for v in e h; do for p in 1x131072 8x131072; do
  timeout 80 ncu --clock-control none --kernel-name kvs_pred_average --launch-skip 20 --launch-count 4 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch ${p%x*} --ctx ${p#*x} --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$p.csv 2>&1
  echo "== ncu $v $p: $(grep -a 'gpu__time_duration\|dram__' $OUT/ncu-$v-$p.csv | awk -F'","' '{printf "%s ", $15}')"
done; done
b() { local n=$1; shift; local t0=$SECONDS; timeout 100 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in e h; do b $v-128k-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

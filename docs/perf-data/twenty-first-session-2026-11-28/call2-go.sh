#!/usr/bin/env bash
# Session 21, call 2: the top-p checks owed on f4cdd55 (quick/small agreement on both paths, determinism,
# memcheck with the right filter); kvs_pred_conv's first convolution one (pixel, channel quad) per thread
# (conflict-free stores, no spills): its checks and its time against main (a), at 3 CTAs per SM (b) and 2 (c).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|compared|agreement:|rror|tokens apart" $OUT/$n.log | head -8; }
PT='quest(budget=L/4) > top_p(p=0.95)'
PP='predictor(budget=L/32); max_seqs=32'
for v in a b c; do timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm $v rc=$?"; done
( t tp-agree-cl 200 env KVS_TOPP_CLUSTER=1 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t tp-agree-tiled 200 env KVS_TOPP_CLUSTER=0 KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t tp-det 200 env KVS_QUICK=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t tp-memcheck 220 env KVS_TOPP_CLUSTER=0 compute-sanitizer --tool memcheck --kernel-name kns=kvs_topp_pass $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-d.txt 2>&1 &
( t pr-decide 220 env KVS_QUICK=1 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture
  t pr-graph 60 $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-e.txt 2>&1 &
( t pr-memcheck 220 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_pred_conv $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture ) > $OUT/par-f.txt 2>&1 &
( t pr-racecheck 220 compute-sanitizer --tool racecheck --kernel-name kns=kvs_pred_conv $D/cuda_predictor cuda_predictor_decode_step_graph --test-threads=1 --nocapture ) > $OUT/par-g.txt 2>&1 &
wait
cat $OUT/par-*.txt
M=gpu__time_duration.sum
for v in a b c; do for bb in 1 8; do
  timeout 100 ncu --clock-control none --kernel-name kvs_pred_conv --launch-skip 30 --launch-count 6 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch $bb --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$v-$bb.csv 2>&1
  echo "== ncu conv $v batch $bb: $(grep -a gpu__time_duration $OUT/ncu-$v-$bb.csv | awk -F'","' '{printf "%s ", $15}')"
done; done
b() { local n=$1; shift; local t0=$SECONDS; timeout 150 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "predictor|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in a b c; do b $v-128k-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 131072 --heads 32/8 --policy "$PP"; done; done
for v in a b c; do b $v-32k $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768 --heads 32/8 --policy "$PP"; done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

#!/usr/bin/env bash
# Session 19, call 7 (main with the v2 tensor-core estimate): racecheck of the estimate to the end, the full
# sparse matrix (base > top_p rows by the agreement contract), top-p agreement on the full matrix (small rows).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|agreement:|error|tokens apart" $OUT/$n.log | head -8; }
( t racecheck 280 compute-sanitizer --tool racecheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-a.txt 2>&1 &
( t matrix 280 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture ) > $OUT/par-b.txt 2>&1 &
( t agree 280 env KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_sets_agree --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
wait
cat $OUT/par-a.txt $OUT/par-b.txt $OUT/par-c.txt
grep -a "^sparse" $OUT/matrix.log | grep -c top_p; grep -a "^sparse" $OUT/matrix.log | grep top_p | grep -v "decisions same" | head
cd $OUT && tar czf all.tgz *.txt *.log && rm -f *.txt *.log; ls $OUT

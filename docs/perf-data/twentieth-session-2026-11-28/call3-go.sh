#!/usr/bin/env bash
# Session 20, call 3: kvs_attn_combine with the split statistics per warp (no block barriers) against the
# old combine (kvsparse-old) — outputs compared through the conformance suite's printed errors, then timed
# (dense, Quest, bf16 and FP8, alternating); the Quest top-k on clusters at batch 8-32 (KVS_QUEST_TOPK);
# the scorer's longer tiles at batch 1 (KVS_QUEST_PAGES_PER_CTA).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|RACECHECK SUMMARY|test result|rror" $OUT/$n.log | head -8; }
( t conf-new 200 $D/kvsparse conformance --quick --seed 20261128 --dense-only ) > $OUT/par-a.txt 2>&1 &
( t conf-old 200 $D/kvsparse-old conformance --quick --seed 20261128 --dense-only ) > $OUT/par-b.txt 2>&1 &
( t cuda 200 $D/cuda --test-threads=1 --nocapture
  t fp8 200 $D/cuda_fp8 --test-threads=1 --nocapture ) > $OUT/par-c.txt 2>&1 &
( t sparseq 200 env KVS_QUICK=1 $D/cuda_sparse cuda_sparse_decisions --test-threads=1 --nocapture
  t memcheck 150 env KVS_QUICK=1 compute-sanitizer --tool memcheck --kernel-name kns=kvs_attn_combine $D/cuda --test-threads=1 ) > $OUT/par-d.txt 2>&1 &
wait
cat $OUT/par-*.txt
echo "== conformance lines: new $(grep -ac . $OUT/conf-new.log) old $(grep -ac . $OUT/conf-old.log)"
# The printed errors with the timing columns dropped: identical outputs print identical errors.
diff <(grep -a "cuda" $OUT/conf-new.log | sed -E 's/[0-9.]+ ?(ms|us|s)\b//g') <(grep -a "cuda" $OUT/conf-old.log | sed -E 's/[0-9.]+ ?(ms|us|s)\b//g') > $OUT/conf-diff.txt; echo "== conformance diff rc=$? lines $(wc -l < $OUT/conf-diff.txt)"; head -6 $OUT/conf-diff.txt
P='quest(budget=L/16)'
b() { local n=$1; shift; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$?"; grep -aE "^quest|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in new old; do
  bin=$D/kvsparse; [ $v = old ] && bin=$D/kvsparse-old
  b $v-bf16-r$r $bin bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"
  b $v-fp8-r$r $bin bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --cache-dtype fp8 --policy "$P"
done; done
b topk-cluster env KVS_QUEST_TOPK=cluster $D/kvsparse bench --device cuda --batch 8,32 --ctx 32768,131072 --heads 32/8 --policy "$P"
b topk-default $D/kvsparse bench --device cuda --batch 8,32 --ctx 32768,131072 --heads 32/8 --policy "$P"
b ppc128 env KVS_QUEST_PAGES_PER_CTA=128 $D/kvsparse bench --device cuda --batch 1 --ctx 32768,131072 --heads 32/8 --policy "$P"
b ppc256 env KVS_QUEST_PAGES_PER_CTA=256 $D/kvsparse bench --device cuda --batch 1 --ctx 32768,131072 --heads 32/8 --policy "$P"
M=gpu__time_duration.sum
for v in kvsparse kvsparse-old; do
  timeout 60 ncu --clock-control none --kernel-name kvs_attn_combine --launch-skip 20 --launch-count 3 --metrics $M --csv $D/$v bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$P" > $OUT/ncu-$v.csv 2>&1
  echo "== ncu $v"; grep -a "gpu__time_duration" $OUT/ncu-$v.csv | awk -F'","' '{print $5, $13, $15}' | head -3
done
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

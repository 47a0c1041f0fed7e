#!/usr/bin/env bash
# Session 22, call 5: where k (history rows from the attention) loses 2% at 32 x 128K: every step a
# calibration step (calib=1) against none (calib=1000000), k against main e, batch 8 and 32 at 128K.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
for v in k e; do ( timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32' > /dev/null 2>&1; echo "== warm $v rc=$?" ) & done; wait
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "^predictor|AttentionPredictor|predictor parts|rror" $OUT/bench-$n.txt | cut -c1-200; }
for c in 1 1000000; do for r in 1 2; do for v in k e; do
  b $v-c$c-r$r $D/kvsparse-$v bench --device cuda --batch 8,32 --ctx 131072 --heads 32/8 --policy "predictor(budget=L/32, calib=$c); max_seqs=32"
done; done; done
M=gpu__time_duration.sum
for v in e k; do
  timeout 150 ncu --clock-control none --kernel-name regex:"kvs_pred_(logits|weights)|kvs_attn_mma" --launch-skip 100 --launch-count 24 --metrics $M --csv $D/kvsparse-$v bench --device cuda --batch 32 --ctx 131072 --heads 32/8 --policy "predictor(budget=L/32, calib=1); max_seqs=32" > $OUT/ncu-$v-c1.csv 2>&1
  echo "== ncu $v rc=$?"; grep -a gpu__time_duration $OUT/ncu-$v-c1.csv | awk -F'","' '{print $5, $15}' | sed 's/"//g' | awk '{k=$1; s[k]=s[k]" "$NF} END {for (k in s) print k, s[k]}'
done
cd $OUT && tar czf all.tgz *.txt *.csv && rm -rf *.txt *.csv; ls $OUT

#!/usr/bin/env bash
# Session 22, call 7: which history launch's PDL costs the calibration steps: KVS_PRED_HIST_PDL =
# all (default) | none | logits (kvs_pred_logits plain) | weights (kvs_pred_weights plain) | lw (both plain).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
timeout 90 $D/kvsparse-k3 bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32' > /dev/null 2>&1; echo "== warm rc=$?"
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|rror" $OUT/bench-$n.txt | cut -c1-200; }
P5='predictor(budget=L/32); max_seqs=32'
for r in 1 2; do for v in all none logits weights lw; do
  b $v-r$r env KVS_PRED_HIST_PDL=$v $D/kvsparse-k3 bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P5"
done; done
for v in all logits lw; do b $v-32k env KVS_PRED_HIST_PDL=$v $D/kvsparse-k3 bench --device cuda --batch 1,8 --ctx 32768 --heads 32/8 --policy "$P5"; done
cd $OUT && tar czf all.tgz *.txt && rm -rf *.txt; ls $OUT

#!/usr/bin/env bash
# Session 22, call 11: kvs_pred_logits (now a plain launch) over one wave (KVS_PRED_LOGITS_PER_SM=2) or two (4)
# instead of 1,024 CTAs: the predicted steps' empty launch against the calibration steps' read of every key.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
timeout 90 $D/kvsparse-x bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32' > /dev/null 2>&1; echo "== warm rc=$?"
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|rror" $OUT/bench-$n.txt | cut -c1-200; }
P5='predictor(budget=L/32); max_seqs=32'
for r in 1 2; do
  b def-r$r $D/kvsparse-x bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P5"
  for k in 2 4; do b sm$k-r$r env KVS_PRED_LOGITS_PER_SM=$k $D/kvsparse-x bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P5"; done
done
cd $OUT && tar czf all.tgz *.txt && rm -rf *.txt; ls $OUT

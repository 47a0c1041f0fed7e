#!/usr/bin/env bash
# Session 21, call 6: ncu (full set) of the predictor's history-row kernels at 1 x 128K (kvs_pred_logits,
# kvs_pred_weights), predicted and calibration steps.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
PP='predictor(budget=L/32); max_seqs=32'
timeout 90 $D/kvsparse bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$PP" > /dev/null 2>&1; echo "== warm rc=$?"
for k in kvs_pred_logits kvs_pred_weights; do
  timeout 150 ncu --clock-control none --kernel-name $k --launch-skip 20 --launch-count 5 --set full $D/kvsparse bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$PP" > $OUT/ncu-$k.txt 2>&1
  echo "== ncu $k rc=$?"; grep -aE "^ +(Duration|Grid Size|Block Size|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|One or More Eligible|Warp Cycles Per Issued)" $OUT/ncu-$k.txt | head -60
done
cd $OUT && tar czf all.tgz *.txt && rm -f *.txt; ls $OUT

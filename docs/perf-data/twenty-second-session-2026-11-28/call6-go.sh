#!/usr/bin/env bash
# Session 22, call 6: calibration steps of k are ~570 us longer at 32 x 128K than main's (e) with the same
# kernel times: PDL? k2 = k with KVS_PRED_HIST_PDL=0 (the history kernels as plain launches); KVS_PDL=0 for all.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
for v in k2 e; do ( timeout 90 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy 'predictor(budget=L/32); max_seqs=32' > /dev/null 2>&1; echo "== warm $v rc=$?" ) & done; wait
b() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$? $((SECONDS-t0))s"; grep -aE "AttentionPredictor|predictor parts|rror" $OUT/bench-$n.txt | cut -c1-200; }
P1='predictor(budget=L/32, calib=1); max_seqs=32'
P5='predictor(budget=L/32); max_seqs=32'
b k2-c1 $D/kvsparse-k2 bench --device cuda --batch 8,32 --ctx 131072 --heads 32/8 --policy "$P1"
b k2-c1-histnopdl env KVS_PRED_HIST_PDL=0 $D/kvsparse-k2 bench --device cuda --batch 8,32 --ctx 131072 --heads 32/8 --policy "$P1"
b k2-c1-nopdl env KVS_PDL=0 $D/kvsparse-k2 bench --device cuda --batch 8,32 --ctx 131072 --heads 32/8 --policy "$P1"
b e-c1-nopdl env KVS_PDL=0 $D/kvsparse-e bench --device cuda --batch 8,32 --ctx 131072 --heads 32/8 --policy "$P1"
b k2-c5-histnopdl env KVS_PRED_HIST_PDL=0 $D/kvsparse-k2 bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P5"
b k2-c5 $D/kvsparse-k2 bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 --policy "$P5"
cd $OUT && tar czf all.tgz *.txt && rm -rf *.txt; ls $OUT

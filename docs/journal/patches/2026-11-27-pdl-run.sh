#!/usr/bin/env bash
# Staged as .device/pdl/run.sh with the CLI and the cuda, cuda_sparse, cuda_fp8 test binaries gzipped in .device/pdl/bin.
# PDL experiment: tests (incl. graph replay), then dense/FP8/Quest benches with KVS_PDL=0 and 1 interleaved.
set -u
D=$(cd "$(dirname "$0")" && pwd); B=$D/bin
for f in $B/*.gz; do gunzip -f $f; done; chmod +x $B/*
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kc
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/device.txt
S=$O/summary.txt
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*" >> $S; }
timeout 170 $B/cuda --test-threads=1 > $O/cuda.log 2>&1; stamp "cuda rc=$? $(grep 'test result' $O/cuda.log)"
timeout 200 $B/cuda_sparse --test-threads=1 cuda_quest cuda_decode_step_write cuda_step_writes cuda_lossless cuda_sparse_decode_step_graph cuda_graph_captured > $O/sparse.log 2>&1; stamp "sparse rc=$? $(grep 'test result' $O/sparse.log)"
grep -E "^test |FAIL|panicked" $O/cuda.log $O/sparse.log | head -40 >> $S
for rep in 1 2; do for pdl in 0 1; do
  KVS_PDL=$pdl timeout 90 $B/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 > $O/dense-$pdl-$rep.txt 2>&1; stamp "dense pdl=$pdl rep=$rep rc=$?"
  KVS_PDL=$pdl timeout 90 $B/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --cache-dtype fp8 > $O/fp8-$pdl-$rep.txt 2>&1; stamp "fp8 pdl=$pdl rep=$rep rc=$?"
  KVS_PDL=$pdl timeout 120 $B/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' > $O/quest-$pdl-$rep.txt 2>&1; stamp "quest pdl=$pdl rep=$rep rc=$?"
done; done
cat $S

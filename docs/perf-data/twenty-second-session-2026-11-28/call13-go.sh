#!/usr/bin/env bash
# Session 22, call 13: the full predictor decisions matrix on main cd65f8b (kvs_pred_logits' one-wave grid).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
timeout 170 $D/cuda_predictor cuda_predictor_decisions --test-threads=1 --nocapture > $OUT/pr-decide-full.log 2>&1; echo "== rc=$?"
grep -aE "FAIL|panicked|test result|compared" $OUT/pr-decide-full.log | head

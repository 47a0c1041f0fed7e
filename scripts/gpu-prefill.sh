#!/usr/bin/env bash
# The prefill kernel's device run (staged by scripts/stage-prefill.sh into .device/NAME): its tests, the
# existing CUDA suites, compute-sanitizer memcheck and racecheck on the prefill tests (KVS_QUICK=1), the
# prefill bench (prefill kernel vs the decode kernel on the same rows, one process) and PyTorch SDPA at
# the same points, and the decode bench of this build against the baseline CLI. Logs under $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=/tmp/kvs-prefill-bin
mkdir -p "$bin" "$OUT"
for f in "$here"/bin/*.gz; do gunzip -c "$f" > "$bin/$(basename "$f" .gz)"; chmod +x "$bin/$(basename "$f" .gz)"; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
date -u | tee -a "$OUT/device.txt"
export KVS_REQUIRE_CUDA=1
step() { # name, timeout, command...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s ))s"
  tail -n "${TAILN:-6}" "$OUT/$name.txt"
}
# Timings first, alone on the device: prefill kernel vs decode kernel, SDPA, shapes, decode vs baseline.
TAILN=8 step bench_prefill 40 "$bin/kvsparse" bench --device cuda --prefill --csv "$OUT/prefill.csv"
TAILN=10 step sdpa_prefill 30 python3 "$here/sdpa_prefill_bench.py" ${SDPA_POINTS:+--points $SDPA_POINTS}
# Shapes (warps, 16-row blocks per warp, keys per tile, stages), prefill kernel only.
for shape in ${SHAPES:-4,2,64,2 4,2,32,4 8,1,32,3}; do
  IFS=, read -r w m n s <<< "$shape"
  KVS_PREFILL_WARPS=$w KVS_PREFILL_MW=$m KVS_PREFILL_BN=$n KVS_PREFILL_STAGES=$s TAILN=4 step "shape_$w-$m-$n-$s" 25 "$bin/kvsparse" bench --device cuda --prefill --points 1x32768,1x2048+30720,8x4096 --old-reps 0
done
TAILN=4 step decode_base 30 "$bin/kvsparse-base" bench --device cuda --batch 1,32 --ctx 32768 --heads 32/8
TAILN=4 step decode_new 30 "$bin/kvsparse" bench --device cuda --batch 1,32 --ctx 32768 --heads 32/8
# Tests (correctness only: run side by side), then the sanitizers on the quick prefill tests.
TAILN=30 step t_prefill ${TEST_S:-150} "$bin/cuda_prefill_tests" --nocapture &
TAILN=12 step t_cuda ${TEST_S:-150} "$bin/cuda_tests" &
TAILN=12 step t_sparse ${TEST_S:-150} "$bin/cuda_sparse_tests" &
TAILN=6 step t_checks ${TEST_S:-150} "$bin/cuda_checks_tests" &
wait
KVS_QUICK=1 step memcheck 40 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/cuda_prefill_tests"
KVS_QUICK=1 step racecheck 40 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/cuda_prefill_tests"

#!/usr/bin/env bash
# One GPU run for the sparse decode path (issue 17): the sparse tests against the CPU engine, the dense
# CUDA tests again (the kernels gained a plan variant), compute-sanitizer on both, the sparse benchmark
# next to our dense kernel and PyTorch SDPA, and the trace eval through the CUDA engine.
# Expects the binaries staged by scripts/stage-device.sh in $DIR/bin. Logs and CSVs go to $OUT.
# Usage: gpu-sparse.sh [merged|mergedsan|tests|quicktests|probe|profile|profile-topp|sanitize|bench|benchonly|eval|conformance|flashinfer|art|all]...
#   art (only when named): ART in the decode kernel (issue 14): its tests (stop tile vs the CPU engine,
#   graph replay), compute-sanitizer on them, the detector-cost bench and the trace eval (~7 min).
#   snapkv (only when named): SnapKV on the device (issue 17): its two-call decisions test, the other
#   sparse tests (the Quest top-k shares its radix select; graph replay, lossless, bad metadata), the
#   trace eval and the bench, the tensor-core choice against the scalar one (~8 min); snapsan: compute-sanitizer on the SnapKV tests (~5 min).
#   (default all)
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export KVS_REQUIRE_CUDA=1
export KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache}
# Scratch on the device: pip --target for the staged wheels, and the conformance reports before they are tarred into $OUT.
SITE=${KVS_SITE:-/tmp/site}
SCRATCH=${KVS_SCRATCH:-/tmp}
summary=()
step() { # name, timeout seconds, command...
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$lim" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  summary+=("$(printf '%-16s rc=%-3s %7sms  %s' "$name" "$rc" "$dt" "$(grep -aE "$GREP" "$OUT/$name.log" | tail -1 | cut -c1-110)")")
  grep -aE "FAIL|DIFF|panicked|error" "$OUT/$name.log" | head -12
  tail -3 "$OUT/$name.log"
}
whats=${*:-all}
has() { [[ " $whats " == *" $1 "* || " $whats " == *" all "* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
if has tests; then
  GREP='test result' step sparse-tests 300 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture
  GREP='test result' step dense-tests 200 "$DIR/bin/cuda_tests" --test-threads=1
fi
if has quicktests; then
  GREP='test result' step sparse-tests 240 env KVS_QUICK=1 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture
  GREP='test result' step dense-tests 120 env KVS_QUICK=1 "$DIR/bin/cuda_tests" --test-threads=1
fi
if has profile; then
  # Per-kernel device time of a sparse step (ncu replays each profiled launch; launches of the metadata
  # build and warm-up are skipped).
  for b in 1 32; do
    GREP='kvs_' step profile-b$b 150 ncu --kernel-name regex:'kvs_(quest|topp|count|plan|attn|meta)' --launch-skip 120 --launch-count 12 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed "$DIR/bin/kvsparse" bench --device cuda --policy 'quest(budget=L/16)' --batch $b --ctx 131072
    grep -aE "kvs_|duration|throughput" "$OUT/profile-b$b.log" | head -40
  done
fi
if has profile-topp; then
  GREP='kvs_' step profile-topp 150 ncu --kernel-name regex:'kvs_(quest|topp|attn)' --launch-skip 150 --launch-count 12 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed "$DIR/bin/kvsparse" bench --device cuda --policy 'quest(budget=L/4) > top_p(p=0.95)' --batch 1 --ctx 131072
  grep -aE "kvs_|duration" "$OUT/profile-topp.log" | head -30
fi
if has benchonly; then
  GREP='x dense|L/|quest' step bench-sparse 300 "$DIR/bin/kvsparse" bench --device cuda --policy 'quest(budget=L/16)' --policy 'quest(budget=L/4) > top_p(p=0.95)' --csv "$OUT/sparse.csv"
fi
if has conformance; then
  # The conformance suite against third-party GPU kernels (docs/conformance.md), reports tarred into $OUT.
  GREP='CONFORMANCE-GPU DONE|passed' step conformance-gpu 330 env OUT="$SCRATCH/conf" KVS_BIN="$DIR/bin/kvsparse" KVS_CUDA_ENGINE=1 bash "$DIR/../scripts/conformance-gpu.sh" reference torch-sdpa torch-sdpa-efficient torch-flex
  grep -aE "passed|failed|HARNESS|DONE|engine" "$OUT/conformance-gpu.log" | tail -12
  (cd "$SCRATCH/conf" && tar czf "$OUT/conformance.tgz" . 2>/dev/null)
fi
if has final; then
  # The last checks of a session: every CUDA test (the NaN/Inf contract included), the Python package
  # driven with CUDA tensors and graphs (scripts/gpu_shim_check.py), kvsparse's own CUDA engine through the
  # conformance suite and sparse contract, then compute-sanitizer on the sparse tests.
  GREP='test result' step dense-tests 150 "$DIR/bin/cuda_tests" --test-threads=1
  GREP='test result' step sparse-tests 150 env KVS_QUICK=1 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture
  if [[ -d "$DIR/shim" ]]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$DIR"/shim/whl/*.whl
    GREP='PASSED|FAIL' step shim 150 env PYTHONPATH="$SITE" KVSPARSE_LIB="$DIR/shim/libkvsparse.so" PYTHONUNBUFFERED=1 python3 "$DIR/../scripts/gpu_shim_check.py"
  fi
  GREP='passed|failed' step engine-conformance 120 "$DIR/bin/kvsparse" conformance --quick --seed 20251123
  GREP='ERROR SUMMARY' step memcheck 220 env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 --skip lossless --skip refuses
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step racecheck 150 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 decisions
fi
if [[ " $whats " == *" art "* ]]; then
  GREP='test result' step art-tests 150 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture art
  grep -aE "rows:|^art " "$OUT/art-tests.log" | tail -14
  GREP='test result' step art-graph 90 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture graph
  grep -aE "^graph" "$OUT/art-graph.log"
  GREP='ERROR SUMMARY' step art-memcheck 150 compute-sanitizer --tool memcheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 art
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step art-racecheck 150 compute-sanitizer --tool racecheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 art
  # Acceptance 2 of issue 14: the detector's cost (patience=inf, vs the same single-split ART launch
  # without the detector, KVS_ART_NOPROBE=1, and vs dense), and the paper's defaults: visited and time.
  GREP='art' step art-bench 150 "$DIR/bin/kvsparse" bench --device cuda --policy 'art(patience=inf)' --policy 'art(tau=1e-5, phi=1e-3, patience=5)' --policy 'art(patience=inf, segment=4096)' --policy 'art(tau=1e-5, phi=1e-3, patience=5, segment=4096)' --batch 1,32 --ctx 32768,131072 --csv "$OUT/art.csv"
  GREP='art' step art-bench-noprobe 90 env KVS_ART_NOPROBE=1 "$DIR/bin/kvsparse" bench --device cuda --policy 'art(patience=inf)' --policy 'art(patience=inf, segment=4096)' --batch 1,32 --ctx 32768,131072 --csv "$OUT/art-noprobe.csv"
  GREP='eval took' step art-eval 120 "$DIR/bin/kvsparse" eval --device cuda --dtype f16 --traces "$DIR/../traces" --policy 'art(tau=1e-5, phi=1e-3, patience=5)' --policy 'art(tau=1e-4, phi=1e-3, patience=5)' --policy 'streaming(sink=64, recent=448) > art(tau=1e-5, phi=1e-3, patience=5)'
  grep -aE "^\| " "$OUT/art-eval.log"
fi
if [[ " $whats " == *" snapkv "* ]]; then
  GREP='test result' step snap-tests 240 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture snapkv
  grep -aE "^snapkv " "$OUT/snap-tests.log" | grep -v " ok$" | head -20
  GREP='test result' step snap-others 300 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture --skip snapkv --skip art_stops --skip decisions
  grep -aE "^(graph|lossless) .*snapkv|FAIL|DIFF" "$OUT/snap-others.log" | head -20
  GREP='eval took' step snap-eval 150 "$DIR/bin/kvsparse" eval --device cuda --traces "$DIR/../traces" --policy 'snapkv(budget=512)' --policy 'snapkv(budget=256, window=16) > top_p(p=0.95)'
  grep -aE "^\| " "$OUT/snap-eval.log"
  GREP='snapkv' step snap-bench 240 "$DIR/bin/kvsparse" bench --device cuda --policy 'snapkv(budget=L/16)' --policy 'snapkv(budget=L/16) > top_p(p=0.95)' --batch 1,8,32 --ctx 32768,131072 --csv "$OUT/snapkv.csv"
  grep -aE "snapkv|choice" "$OUT/snap-bench.log"
  # The scalar choice (the kernels before issue 35's tensor-core path) as the baseline in the same binary;
  # 32 x 128K left out (~0.35 s per choice, ~1 min of timing).
  GREP='snapkv' step snap-bench-scalar 200 env KVS_BENCH_SNAP_SCALAR=1 "$DIR/bin/kvsparse" bench --device cuda --policy 'snapkv(budget=L/16)' --batch 1,8 --ctx 32768,131072 --csv "$OUT/snapkv-scalar.csv"
  grep -aE "choice" "$OUT/snap-bench-scalar.log"
fi
if [[ " $whats " == *" snapsan "* ]]; then
  GREP='ERROR SUMMARY' step snap-memcheck 200 env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 snapkv
  GREP='ERROR SUMMARY' step snap-memcheck-bad 120 compute-sanitizer --tool memcheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 bad_device
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step snap-racecheck 200 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 snapkv
fi
if [[ " $whats " == *" merged "* ]]; then
  # Issue 14 after the merge of ART-behind-Quest, RefreshKV, PRR and the predictor: every CUDA test binary
  # (reduced matrices) in one process each (~7 min).
  GREP='test result' step dense-tests 120 "$DIR/bin/cuda_tests" --test-threads=1
  GREP='test result' step sparse-tests 200 env KVS_QUICK=1 "$DIR/bin/cuda_sparse_tests" --test-threads=1 --nocapture
  for t in refresh prr predictor; do
    GREP='test result' step $t-tests 100 env KVS_QUICK=1 "$DIR/bin/cuda_${t}_tests" --test-threads=1 --nocapture
  done
fi
if [[ " $whats " == *" mergedsan "* ]]; then
  # The merged stateful policies through the Python package (captured multi-layer steps == eager, no sync,
  # vs the CPU engine), compute-sanitizer on their tests, the engine's conformance suite (~8 min).
  if [[ -d "$DIR/shim" ]]; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$DIR"/shim/whl/*.whl
    i=0
    for pol in ${KVS_SHIM_POLICIES:-'quest(budget=256, sink=16) > art(tau=1e-3, phi=1e-2, patience=2)' 'refresh(k=256, stride=2, s=0.9)' 'speculate(over=quest(budget=256), budget=256)' 'predictor(budget=256); max_seqs=16'}; do
      i=$((i+1))
      GREP='PASSED|FAIL' step shim-$i 75 env PYTHONPATH="$SITE" KVSPARSE_LIB="$DIR/shim/libkvsparse.so" PYTHONUNBUFFERED=1 python3 "$DIR/../scripts/gpu_shim_check.py" --policy "$pol"
    done
  fi
  for t in refresh prr predictor; do
    GREP='ERROR SUMMARY' step $t-memcheck 75 env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_${t}_tests" --test-threads=1 decisions
  done
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step predictor-racecheck 150 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_predictor_tests" --test-threads=1 graph
  GREP='passed|failed' step engine-conformance 90 "$DIR/bin/kvsparse" conformance --quick --seed 20251125
fi
if [[ " $whats " == *" shimstate "* ]]; then
  # The stateful policies through the Python package (scripts/gpu_shim_check.py; its graph rounds re-run a
  # replayed step eagerly on the same engine, which a policy whose state the replay advanced cannot pass:
  # docs/vllm.md), and racecheck on the predictor's graph test with a longer limit.
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$DIR"/shim/whl/*.whl
  i=0
  for pol in 'refresh(k=256, stride=2, s=0.9)' 'speculate(over=quest(budget=256), budget=256)' 'predictor(budget=256); max_seqs=16' 'snapkv(budget=256)'; do
    i=$((i+1))
    GREP='PASSED|FAIL' step shimst-$i 80 env PYTHONPATH="$SITE" KVSPARSE_LIB="$DIR/shim/libkvsparse.so" PYTHONUNBUFFERED=1 python3 "$DIR/../scripts/gpu_shim_check.py" --policy "$pol"
  done
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step predictor-racecheck 230 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_predictor_tests" --test-threads=1 graph
fi
if has probe; then
  GREP='quest' step bench-probe 120 "$DIR/bin/kvsparse" bench --device cuda --policy 'quest(budget=L/16)' --batch 1,32 --ctx 131072
fi
if has flashinfer; then
  # FlashInfer's paged decode through the conformance adapter (wheels in .whl/, JIT per shape), reports tarred.
  GREP='flashinfer-decode on|DONE' step conformance-fi 300 env OUT="$SCRATCH/conf-fi" KVS_BIN="$DIR/bin/kvsparse" KVS_BUDGET=${KVS_FI_BUDGET:-240} bash "$DIR/../scripts/conformance-gpu.sh" flashinfer-decode
  (cd "$SCRATCH/conf-fi" && tar czf "$OUT/conformance-fi.tgz" . 2>/dev/null)
fi
if has sanitize; then
  GREP='ERROR SUMMARY' step memcheck 400 env KVS_QUICK=1 compute-sanitizer --tool memcheck "$DIR/bin/cuda_sparse_tests" --test-threads=1
  GREP='RACECHECK SUMMARY|ERROR SUMMARY' step racecheck 400 env KVS_QUICK=1 compute-sanitizer --tool racecheck "$DIR/bin/cuda_sparse_tests" --test-threads=1 decisions
fi
if has bench; then
  GREP='x dense|L/|quest' step bench-sparse 480 "$DIR/bin/kvsparse" bench --device cuda --policy 'quest(budget=L/16)' --policy 'quest(budget=L/4) > top_p(p=0.95)' --csv "$OUT/sparse.csv"
  GREP='done' step sdpa 300 env PYTHONUNBUFFERED=1 python3 "$DIR/sdpa_bench.py" --csv "$OUT/sdpa.csv" --batch 1,8,32 --ctx 16384,32768,131072 --heads 32/8
  python3 "$DIR/compare_sparse.py" "$OUT/sparse.csv" "$OUT/sdpa.csv" | tee "$OUT/compare_sparse.txt"
fi
if has eval; then
  GREP='quest|dense' step eval-cuda 400 "$DIR/bin/kvsparse" eval --device cuda --traces "$DIR/../traces" --policy 'quest(budget=512)' --policy 'quest(budget=512, sink=16)' --policy 'streaming(sink=4, recent=508)' --policy 'quest(budget=2048) > top_p(p=0.95)' --policy 'all > top_p(p=0.95)'
fi
(cd "$OUT" && tar czf logs.tgz --remove-files *.log 2>/dev/null)
echo "==== summary ===="
printf '%s\n' "${summary[@]}"

#!/usr/bin/env bash
# One GPU run for the device-side checks of issue 33: the new CUDA tests (tests/cuda_checks.rs) and every
# existing CUDA test binary, compute-sanitizer memcheck on the new tests, and the dense decode benchmark
# at batch 1 x 32K and 32 x 8K, this build against a baseline binary, interleaved, with a before/after
# table. Expects the binaries (gzipped, stripped) in $DIR/bin as staged by scripts/stage-device-checks.sh:
# kvsparse, kvsparse-base, cuda_checks_tests, cuda_tests, cuda_sparse_tests, cuda_refresh_tests,
# cuda_prr_tests, cuda_predictor_tests. Logs go to $OUT (default ./gpu-out); the last lines printed are a
# summary. Usage: gpu-device-checks.sh [all|new|tests|sanitize|bench]   (default all; each part alone
# fits in 10 minutes on an H100: new ~1 min, tests ~6, sanitize ~3, bench ~4)
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
what=${1:-all}
export KVS_REQUIRE_CUDA=1
export KVS_KERNEL_CACHE=/tmp/kvs-kernel-cache-h33
BIN=/tmp/kvs-h33-bin
mkdir -p "$BIN"
for f in "$DIR"/bin/*.gz; do
  b=$(basename "$f" .gz)
  [[ -x $BIN/$b && $BIN/$b -nt $f ]] || { gunzip -c "$f" >"$BIN/$b" && chmod +x "$BIN/$b"; }
done
summary=()
step() { # name, grep pattern for the summary line, command...
  local name=$1 pat=$2 t0=$SECONDS rc; shift 2
  "$@" >"$OUT/$name.log" 2>&1; rc=$?
  summary+=("$(printf '%-22s rc=%-3s %5ss  ' "$name" "$rc" "$((SECONDS - t0))")$(grep -aE "$pat" "$OUT/$name.log" | tail -1 | cut -c1-100)")
  tail -4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/device.txt"
if [[ $what == all || $what == new || $what == tests ]]; then
  step cuda-checks 'test result' "$BIN/cuda_checks_tests" --test-threads=1 --nocapture
fi
if [[ $what == all || $what == tests ]]; then
  for t in cuda cuda_sparse cuda_refresh cuda_prr cuda_predictor; do
    step "$t" 'test result' "$BIN/${t}_tests" --test-threads=1
  done
fi
if [[ $what == all || $what == sanitize ]]; then
  step memcheck-checks 'ERROR SUMMARY' env KVS_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_checks_tests" --test-threads=1
  step memcheck-badmeta 'ERROR SUMMARY' compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_tests" --test-threads=1 cuda_bad_device_metadata
fi
if [[ $what == all || $what == bench ]]; then
  # Dense decode step, baseline and this build interleaved (3 rounds each) so clock drift hits both.
  for r in 1 2 3; do
    for v in base new; do
      exe=$BIN/kvsparse; [[ $v == base ]] && exe=$BIN/kvsparse-base
      step "bench-$v-$r" 'copy' "$exe" bench --device cuda --batch 1,32 --ctx 8192,32768 --heads 32/8 --csv "$OUT/bench-$v-$r.csv"
    done
  done
  python3 - "$OUT" <<'EOF' | tee "$OUT/bench-table.txt"
import csv, glob, os, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "bench-*-*.csv"))):
    v = os.path.basename(path).split("-")[1]
    for r in csv.DictReader(open(path)):
        rows.setdefault((int(r["batch"]), int(r["ctx"])), {}).setdefault(v, []).append(float(r["us"]))
print("dense decode step, heads 32/8, head 128, bf16, block 16 (median over 3 interleaved runs of the bench's median)")
print(f"{'batch x ctx':>12} {'base us':>9} {'new us':>9} {'change':>8}   runs base / new")
for (b, c), d in sorted(rows.items()):
    if "base" not in d or "new" not in d:
        continue
    mb, mn = statistics.median(d["base"]), statistics.median(d["new"])
    flag = "  <- the issue's points" if (b, c) in ((1, 32768), (32, 8192)) else ""
    print(f"{b:>5} x {c:<6} {mb:>9.1f} {mn:>9.1f} {100 * (mn - mb) / mb:>+7.2f}%   {' '.join(f'{x:.1f}' for x in d['base'])} / {' '.join(f'{x:.1f}' for x in d['new'])}{flag}")
EOF
fi
(cd "$OUT" && tar czf "logs-$what.tgz" *.log 2>/dev/null && rm -f *.log)
echo "==== summary ===="
printf '%s\n' "${summary[@]}"

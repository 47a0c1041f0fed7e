#!/usr/bin/env bash
# One GPU run for the device-side checks of issue 33: the new CUDA tests (tests/cuda_checks.rs) and every
# existing CUDA test binary staged, compute-sanitizer memcheck on the new tests, and the dense decode
# benchmark at batch 1 x 8K, 1 x 32K and 32 x 8K: this build with the checks, the same build with them
# compiled out (KVS_BENCH_NO_DEVICE_CHECKS=1), and the baseline binaries staged (kvsparse-base, and
# kvsparse-main when present), interleaved, with a table of medians and spreads. Expects the binaries
# (gzipped, stripped) in $DIR/bin as staged by scripts/stage-device-checks.sh. Logs go to $OUT (default
# ./gpu-out); the last lines printed are a summary.
# Usage: gpu-device-checks.sh [all|new|tests|sanitize|bench]...   (default all; bench: ROUNDS=3 rounds,
# BATCH=1,32 CTX=8192,32768 MAX_KV_GIB=40 (1.5 skips 32 x 32K); each part alone fits in 10 minutes on an
# H100: new ~1 min, tests ~6, sanitize ~3, bench ~2-4)
set -uo pipefail
DIR=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
parts=" ${*:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }
export KVS_REQUIRE_CUDA=1
export KVS_KERNEL_CACHE=/tmp/kvs-kernel-cache-checks
BIN=/tmp/kvs-checks-bin
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
if want new || want tests; then
  step cuda-checks 'test result' "$BIN/cuda_checks_tests" --test-threads=1 --nocapture
fi
if want tests; then
  for t in cuda cuda_sparse cuda_refresh cuda_prr cuda_predictor; do
    [[ -x $BIN/${t}_tests ]] && step "$t" 'test result' "$BIN/${t}_tests" --test-threads=1
  done
fi
if want bench; then
  # Dense decode step; the variants interleaved (ROUNDS rounds) so clock drift hits all alike.
  # VARIANTS: new, off (KVS_BENCH_NO_DEVICE_CHECKS=1), norows / noseqs (=rows / =seqs: one part compiled
  # out), base, main.
  read -r -a variants <<<"${VARIANTS:-new off base}"
  [[ -x $BIN/kvsparse-main && -z ${VARIANTS:-} ]] && variants+=(main)
  for r in $(seq 1 "${ROUNDS:-3}"); do
    for v in "${variants[@]}"; do
      exe=$BIN/kvsparse; env=()
      case $v in
        base) exe=$BIN/kvsparse-base ;;
        main) exe=$BIN/kvsparse-main ;;
        off) env=(KVS_BENCH_NO_DEVICE_CHECKS=1) ;;
        norows) env=(KVS_BENCH_NO_DEVICE_CHECKS=rows) ;;
        noseqs) env=(KVS_BENCH_NO_DEVICE_CHECKS=seqs) ;;
      esac
      step "bench-$v-$r" 'copy' env "${env[@]}" "$exe" bench --device cuda --batch "${BATCH:-1,32}" --ctx "${CTX:-8192,32768}" --heads 32/8 --max-kv-gib "${MAX_KV_GIB:-40}" --csv "$OUT/bench-$v-$r.csv"
    done
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/bench-table.txt"
import csv, glob, os, statistics, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "bench-*-*.csv"))):
    v = os.path.basename(path).split("-")[1]
    for r in csv.DictReader(open(path)):
        rows.setdefault((int(r["batch"]), int(r["ctx"])), {}).setdefault(v, []).append(float(r["us"]))
names = {"base": "before the checks (kvsparse-base)", "main": "kvsparse-main", "off": "this build, checks compiled out",
         "norows": "this build without the rows' checks", "noseqs": "this build without the sequences' checks and counters", "new": "this build"}
print("dense decode step, heads 32/8, head 128, bf16, block 16: median of the rounds' medians [min-max], us; change vs base")
for (b, c), d in sorted(rows.items()):
    if "base" not in d:
        continue
    mb = statistics.median(d["base"])
    cells = []
    for v in ("base", "main", "off", "norows", "noseqs", "new"):
        if v in d:
            m = statistics.median(d[v])
            cells.append(f"{v} {m:.1f} [{min(d[v]):.1f}-{max(d[v]):.1f}] {100 * (m - mb) / mb:+.2f}%")
    print(f"{b:>3} x {c:<6} " + " | ".join(cells))
print("variants: " + "; ".join(f"{k} = {v}" for k, v in names.items()))
PY
fi
if want sanitize; then
  step memcheck-checks 'ERROR SUMMARY' env KVS_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_checks_tests" --test-threads=1
  [[ -x $BIN/cuda_tests ]] && step memcheck-badmeta 'ERROR SUMMARY' compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_tests" --test-threads=1 cuda_bad_device_metadata
fi
(cd "$OUT" && tar czf "logs.tgz" *.log 2>/dev/null && rm -f *.log)
echo "==== summary ===="
printf '%s\n' "${summary[@]}"

#!/usr/bin/env bash
# Session 19, call 2 (main 00ae4fb): where top-p's time goes at batch 8 (ncu per kernel, tiled) and the
# cluster forced at batch 8; where quest > art's time goes (ncu per kernel) next to Quest alone; memcheck of
# the estimate with 1-4 candidates per thread.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
summ() { python3 - "$1" <<'PY'
import csv, sys, statistics, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[0] != "ID"]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    try: d[r[4]+' '+r[8]][r[12]].append(float(r[14].replace(",", "")))
    except ValueError: pass
print("==", sys.argv[1].split("/")[-1])
for k, m in d.items():
    print(f"  {k[:50]:50s} n={len(next(iter(m.values())))}", "  ".join(f"{n.split('__')[1][:18]}={statistics.median(v):.4g}" for n, v in m.items()))
PY
}
M=gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
P='quest(budget=L/4) > top_p(p=0.95)'
A='quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)'
Q='quest(budget=L/16)'
timeout 120 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$Q" --policy "$A" > $OUT/bench-art.txt 2>&1
echo "== bench art"; grep -E "^quest" $OUT/bench-art.txt
KVS_TOPP_CLUSTER=1 timeout 90 $D/kvsparse bench --device cuda --batch 8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-topp-cl8.txt 2>&1
echo "== topp cluster forced at batch 8"; grep -E "top_p" $OUT/bench-topp-cl8.txt
for c in 32768 131072; do
  timeout 100 ncu --clock-control none --kernel-name regex:'kvs_' --launch-skip 40 --launch-count 30 --metrics $M \
    --csv $D/kvsparse bench --device cuda --batch 8 --ctx $c --heads 32/8 --policy "$P" > $OUT/ncu-topp-8-$c.csv 2>&1
  summ $OUT/ncu-topp-8-$c.csv
done
for b in 1 8; do
  timeout 100 ncu --clock-control none --kernel-name regex:'kvs_' --launch-skip 40 --launch-count 30 --metrics $M \
    --csv $D/kvsparse bench --device cuda --batch $b --ctx 131072 --heads 32/8 --policy "$A" > $OUT/ncu-art-$b-131072.csv 2>&1
  summ $OUT/ncu-art-$b-131072.csv
done
t0=$SECONDS; timeout 150 compute-sanitizer --tool memcheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture > $OUT/memcheck.log 2>&1
echo "== memcheck rc=$? $((SECONDS-t0))s"; grep -aE "ERROR SUMMARY|test result" $OUT/memcheck.log
cd $OUT && tar czf all.tgz *.txt *.log *.csv && rm -f *.txt *.log *.csv; ls $OUT

#!/usr/bin/env bash
# Session 18, call 4: where top-p's time goes at batch 1 (ncu per kernel, cluster vs tiled; SASS view of
# kvs_topp_cluster at 1 x 128K).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
P='quest(budget=L/4) > top_p(p=0.95)'
for v in cluster tiled; do for c in 32768 131072; do
  e=1; [ $v = tiled ] && e=0
  KVS_TOPP_CLUSTER=$e timeout 100 ncu --clock-control none --kernel-name regex:'kvs_(quest|topp|attn|combine)' --launch-skip 60 --launch-count 24 \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    --csv $D/kvsparse bench --device cuda --batch 1 --ctx $c --heads 32/8 --policy "$P" > $OUT/ncu-$v-$c.csv 2>&1
  python3 - $OUT/ncu-$v-$c.csv <<'PY'
import csv, sys, statistics, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[0] != "ID"]
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in rows:
    try: d[r[4]][r[12]].append(float(r[14].replace(",", "")))
    except ValueError: pass
print("==", sys.argv[1].split("/")[-1])
for k, m in d.items():
    print(f"  {k[:40]:40s}", "  ".join(f"{n.split('__')[1][:22]}={statistics.median(v):.4g}" for n, v in m.items()))
PY
done; done
KVS_TOPP_CLUSTER=1 timeout 120 ncu --clock-control none --kernel-name kvs_topp_cluster --launch-skip 20 --launch-count 1 --section SourceCounters --section WarpStateStats --section SchedulerStats -o $OUT/cl-1x128k $D/kvsparse bench --device cuda --batch 1 --ctx 131072 --heads 32/8 --policy "$P" > /dev/null 2>&1
ncu -i $OUT/cl-1x128k.ncu-rep --page source --csv --print-source sass > $OUT/cl-sass.csv 2>&1
ncu -i $OUT/cl-1x128k.ncu-rep --page details --csv > $OUT/cl-details.csv 2>&1
rm -f $OUT/cl-1x128k.ncu-rep; ls -la $OUT

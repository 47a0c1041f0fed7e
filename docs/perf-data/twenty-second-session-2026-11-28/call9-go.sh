#!/usr/bin/env bash
# Session 22, call 9: does PDL hurt elsewhere as it did the predictor's calibration steps? Main's build (m),
# every GPU policy at 128K x batch 1, 8, 32 with KVS_PDL unset and =0, alternating.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
POL=(--policy 'quest(budget=L/16)' --policy 'quest(budget=L/4) > top_p(p=0.95)' --policy 'snapkv(budget=L/16)' --policy 'refresh(k=L/16, every=5)' --policy 'quest(budget=L/16) > art(tau=1e-5, phi=1e-3, patience=5)')
timeout 120 $D/kvsparse-m bench --device cuda --batch 1 --ctx 4096 --heads 32/8 "${POL[@]}" > /dev/null 2>&1; echo "== warm rc=$?"
for r in 1 2; do for p in 1 0; do
  t0=$SECONDS; KVS_PDL=$p timeout 200 $D/kvsparse-m bench --device cuda --batch 1,8,32 --ctx 131072 --heads 32/8 "${POL[@]}" > $OUT/bench-pdl$p-r$r.txt 2>&1
  echo "== pdl=$p r$r rc=$? $((SECONDS-t0))s"; grep -aE "^(quest|snapkv|refresh)|RefreshKV: mean|rror" $OUT/bench-pdl$p-r$r.txt | cut -c1-160
done; done
cd $OUT && tar czf all.tgz *.txt && rm -rf *.txt; ls $OUT

#!/usr/bin/env bash
# Session 19, call 6 (call 5 ran the same without --graph): issue 34's peer column. Quest assembled from PyTorch + FlashInfer 0.7.2 (scripts/
# peer_quest_bench.py: page scores in torch, flashinfer.top_k_page_table_transform, FlashInfer paged decode
# per KV head; flashinfer.top_k alone; FlashInfer dense) with FlashInfer's modules prebuilt for sm_90a
# (.device/fi-aot, FLASHINFER_DISABLE_JIT=1: nothing compiles here), and ours (kvsparse bench) in the same call.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$D/../.." && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
SITE=/tmp/fisite
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $ROOT/.device/fiwhl/*.whl 2>&1 | tail -2
python3 -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)"
export PYTHONPATH=$ROOT/.device/fi-aot:$SITE FLASHINFER_DISABLE_JIT=1
timeout 60 python3 $ROOT/.device/fi-aot/check_aot.py 2>&1 | tail -3
timeout 120 $D/kvsparse bench --device cuda --batch 1,8,32 --ctx 32768,131072 --heads 32/8 --policy 'quest(budget=L/16)' > $OUT/ours-quest.txt 2>&1
echo "== ours"; grep -E "^quest|copy" $OUT/ours-quest.txt
for m in graph eager; do
  f=""; [ $m = graph ] && f="--graph"
  t0=$SECONDS; timeout 200 python3 $ROOT/scripts/peer_quest_bench.py $f --csv $OUT/peer-quest-$m.csv --batch 1,8,32 --ctx 32768,131072 > $OUT/peer-quest-$m.txt 2>&1
  echo "== peer $m rc=$? $((SECONDS-t0))s"; tail -12 $OUT/peer-quest-$m.txt
done
ls $OUT

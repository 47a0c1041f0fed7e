#!/usr/bin/env bash
# Session 20, call 7: top-p's bin_add with the butterfly for up to 0 / 1 / 2 distinct bins per warp (else each
# lane's own shared atomics) against 4 (main): select time, alternating, two rounds.
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
P='quest(budget=L/4) > top_p(p=0.95)'
for v in l4 l0 l1 l2; do timeout 60 $D/kvsparse-$v bench --device cuda --batch 1 --ctx 4096 --heads 32/8 --policy "$P" > /dev/null 2>&1; done
b() { local n=$1; shift; timeout 40 "$@" > $OUT/bench-$n.txt 2>&1; echo "== bench $n rc=$?"; grep -aE "top_p|rror" $OUT/bench-$n.txt; }
for r in 1 2; do for v in l4 l0 l1 l2; do b $v-r$r $D/kvsparse-$v bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P"; done; done
cd $OUT && tar czf all.tgz *.txt && rm -f *.txt; ls $OUT

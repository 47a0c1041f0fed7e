#!/usr/bin/env bash
# Session 19, call 1: Quest's plan attention split finer at small batch (env only, no code change);
# owed checks of kvs_topp_cluster (racecheck to the end, determinism, graph); branch s18-topp-etile
# (agreement, ties, bench against main in the same call).
set -uo pipefail
D=$(cd "$(dirname "$0")" && pwd)
export KVS_REQUIRE_CUDA=1 KVS_KERNEL_CACHE=/tmp/kvs-kc
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/device.txt
t() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $((SECONDS-t0))s"; grep -aE "FAIL|DIFF|panicked|ERROR SUMMARY|test result|determinism|graph |agreement:|error" $OUT/$n.log | head -6; }
Q='quest(budget=L/16)'
for v in def c128 c64 c64k128 c32k64; do
  case $v in def) e="X=1";; c128) e="KVS_CUDA_MIN_CHUNK=128";; c64) e="KVS_CUDA_MIN_CHUNK=64";; c64k128) e="KVS_CUDA_MIN_CHUNK=64 KVS_CUDA_CTA_COST=128";; c32k64) e="KVS_CUDA_MIN_CHUNK=32 KVS_CUDA_CTA_COST=64";; esac
  env $e timeout 100 $D/kvsparse bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$Q" > $OUT/bench-quest-$v.txt 2>&1
  echo "== quest $v ($e)"; grep -E "^quest" $OUT/bench-quest-$v.txt
done
# Correctness in parallel (GPU shared; no timing here).
( t racecheck 330 compute-sanitizer --tool racecheck $D/cuda_top_p cuda_top_p_ties --test-threads=1 --nocapture ) > $OUT/par-race.txt 2>&1 &
( t determ 200 env KVS_TOPP_CLUSTER=1 KVS_TOPP_SMALL=1 $D/cuda_top_p cuda_top_p_is_deterministic --test-threads=1 --nocapture
  t sgraph 100 $D/cuda_sparse cuda_sparse_decode_step_graph_replays_on_new_data --test-threads=1 --nocapture
  t sgraph2 60 $D/cuda_sparse cuda_graph_captured_on_a_stream_without_eager_calls --test-threads=1 --nocapture ) > $OUT/par-main.txt 2>&1 &
( t e-agree 200 env KVS_QUICK=1 KVS_TOPP_SMALL=1 $D/cuda_top_p-etile cuda_top_p_sets_agree --test-threads=1 --nocapture
  t e-ties 100 $D/cuda_top_p-etile cuda_top_p_ties --test-threads=1 --nocapture
  t e-graph 60 $D/cuda_top_p-etile cuda_top_p_graph --test-threads=1 --nocapture ) > $OUT/par-etile.txt 2>&1 &
wait
cat $OUT/par-main.txt $OUT/par-etile.txt $OUT/par-race.txt
grep -a "case\|hazard" $OUT/racecheck.log | tail -3
P='quest(budget=L/4) > top_p(p=0.95)'
for v in main etile; do
  cmd=$D/kvsparse; [ $v = etile ] && cmd=$D/kvsparse-etile
  timeout 90 $cmd bench --device cuda --batch 1,8 --ctx 32768,131072 --heads 32/8 --policy "$P" > $OUT/bench-topp-$v.txt 2>&1
  echo "== topp $v"; grep -E "top_p" $OUT/bench-topp-$v.txt
done
cd $OUT && tar czf all.tgz *.txt *.log && rm -f *.txt *.log; ls $OUT

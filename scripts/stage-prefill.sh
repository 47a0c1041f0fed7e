#!/usr/bin/env bash
# Stages scripts/gpu-prefill.sh into $1 (default .device/prefill): this build's CLI and CUDA test
# binaries and a baseline CLI ($BASE, required), stripped and gzipped.
set -euo pipefail
dest=$(realpath -m "${1:-.device/prefill}")
base=$(realpath -m "${BASE:?set BASE to a baseline kvsparse CLI to compare against, e.g. one built from main}")
cd "$(dirname "$0")/.."
cargo build --release --bins -q
cargo test --release --no-run -q -p kvsparse-conformance 2>/dev/null
mkdir -p "$dest/bin"
rm -f "$dest"/bin/*
newest() { ls -t target/release/deps/$1-* | grep -v '\.d$' | head -1; }
pack() { strip --strip-all -o "$dest/bin/$2" "$1" && gzip -9 -f "$dest/bin/$2"; }
pack target/release/kvsparse kvsparse
pack "$base" kvsparse-base
for t in cuda_prefill cuda_checks cuda cuda_sparse; do
  pack "$(newest $t)" "${t}_tests"
done
cp scripts/gpu-prefill.sh scripts/sdpa_prefill_bench.py scripts/cuda_timing.py "$dest/"
du -sh "$dest"

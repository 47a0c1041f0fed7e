#!/usr/bin/env bash
# Stages scripts/gpu-prefill.sh into $1 (default /work/main/.device/h36): this build's CLI and CUDA test
# binaries and a baseline CLI ($BASE, default /work/main/target/release/kvsparse), stripped and gzipped.
set -euo pipefail
dest=${1:-/work/main/.device/h36}
base=${BASE:-/work/main/target/release/kvsparse}
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
cp scripts/gpu-prefill.sh scripts/sdpa_prefill_bench.py "$dest/"
du -sh "$dest"

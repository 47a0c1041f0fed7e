#!/usr/bin/env bash
# Builds the release binaries here and copies what a GPU run needs into $1 (default .device under the repository root):
# the CLI, the CUDA test binaries (debug info stripped), the GPU run scripts and the SDPA script.
set -euo pipefail
dest=$(realpath -m "${1:-.device}")
cd "$(dirname "$0")/.."
cargo build --release --bins -q
cargo test --release --no-run -q 2>/dev/null || true
mkdir -p "$dest/bin"
cp target/release/kvsparse "$dest/bin/kvsparse"
newest() { ls -t target/release/deps/$1-* | grep -v '\.d$' | head -1; }
cp "$(newest cuda)" "$dest/bin/cuda_tests"
cp "$(newest cuda_sparse)" "$dest/bin/cuda_sparse_tests"
strip --strip-debug "$dest/bin/kvsparse" "$dest/bin/cuda_tests" "$dest/bin/cuda_sparse_tests"
# The stateful policies' multi-step tests (one binary each, where the branch has them).
for t in cuda_refresh cuda_prr cuda_predictor; do
  if ls target/release/deps/$t-* >/dev/null 2>&1; then
    cp "$(newest $t)" "$dest/bin/${t}_tests"
    strip --strip-debug "$dest/bin/${t}_tests"
  fi
done
cp scripts/gpu-check.sh scripts/gpu-sparse.sh scripts/mma-tune.sh scripts/clock-probe.sh scripts/sdpa_bench.py scripts/peer_decode_bench.py scripts/cuda_timing.py scripts/compare.py scripts/compare_sparse.py "$dest/"
du -sh "$dest"

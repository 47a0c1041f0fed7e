#!/usr/bin/env bash
# Stages the GPU run of scripts/gpu-device-checks.sh into $1 (default .device/checks): this
# build's CLI and CUDA test binaries, and a baseline CLI ($BASE, required)
# as kvsparse-base (and $MAIN, when set, as kvsparse-main), stripped and gzipped (the folder travels to
# the device: keep it small). TESTS (default: every CUDA test binary) names the test binaries to stage.
set -euo pipefail
dest=$(realpath -m "${1:-.device/checks}")
base=$(realpath -m "${BASE:?set BASE to a baseline kvsparse CLI to compare against, e.g. one built from main}")
tests=${TESTS:-cuda_checks cuda cuda_sparse cuda_refresh cuda_prr cuda_predictor}
cd "$(dirname "$0")/.."
cargo build --release --bins -q
for t in $tests; do cargo test --release --no-run -q -p kvsparse-conformance --test "$t" 2>/dev/null; done
mkdir -p "$dest/bin"
rm -f "$dest"/bin/*
newest() { ls -t target/release/deps/$1-* | grep -v '\.d$' | head -1; }
pack() { # source, name
  strip --strip-all -o "$dest/bin/$2" "$1"
  gzip -9 -f "$dest/bin/$2"
}
pack target/release/kvsparse kvsparse
pack "$base" kvsparse-base
[[ -n ${MAIN:-} ]] && pack "$MAIN" kvsparse-main
for t in $tests; do
  pack "$(newest $t)" "${t}_tests"
done
cp scripts/gpu-device-checks.sh "$dest/"
du -sh "$dest"

#!/usr/bin/env bash
# Stages for scripts/vllm-gpu-run.sh, into $1 (default .device/h32, git-ignored; carried to the GPU machine
# next to the vLLM wheelhouse that ../shared/tools/device-carry lands there): the kvsparse wheel (this
# checkout's python_shim with a stripped release libkvsparse.so inside) and cp312 manylinux wheels of cffi and
# pycparser (the machine has neither), and the run scripts (scripts/vllm-gpu-run.sh, vllm_gpu_run.py), so
# that `bash $1/vllm-gpu-run.sh ...` runs from any checkout's copy there. The machine has python3.12, torch 2.11 (CUDA 13), no Rust, no network.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.device/h32}
cargo build --release --lib -q
tmp=$(mktemp -d)
cp target/release/libkvsparse.so "$tmp/libkvsparse.so"
strip --strip-debug "$tmp/libkvsparse.so"
rm -rf "$dest/whl" && mkdir -p "$dest/whl"
KVSPARSE_LIB="$tmp/libkvsparse.so" python3 -m pip wheel -q --no-deps ./python_shim -w "$dest/whl"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest/whl" cffi pycparser
rm -rf "$tmp" python_shim/build
cp scripts/vllm_gpu_run.py scripts/vllm-gpu-run.sh "$dest/"
# What the run script compares with the machine's install (a new stage reinstalls).
(git rev-parse HEAD; git status --porcelain; sha256sum "$dest"/whl/*.whl) | sha256sum | cut -d' ' -f1 >"$dest/STAMP"
ls -l "$dest/whl"; du -sh "$dest"

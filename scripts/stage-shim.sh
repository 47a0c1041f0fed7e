#!/usr/bin/env bash
# Stages what scripts/gpu_shim_check.py needs on the GPU machine, which has python3 with torch but neither
# cffi nor a Rust toolchain: the release cdylib and cp312 manylinux wheels of cffi and pycparser, into $1
# (default .device/shim, git-ignored; carry `.device` to the device). There, in the repo root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/shim/whl/*.whl &&
#   PYTHONPATH=/tmp/site KVSPARSE_LIB=.device/shim/libkvsparse.so PYTHONUNBUFFERED=1 python3 scripts/gpu_shim_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.device/shim}
cargo build --release --lib -q
mkdir -p "$dest/whl"
cp target/release/libkvsparse.so "$dest/libkvsparse.so"
strip --strip-debug "$dest/libkvsparse.so"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest/whl" \
  cffi==2.1.1 pycparser==3.12
du -sh "$dest"

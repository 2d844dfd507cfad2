#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with an NVIDIA GPU (a few minutes):
# the GPU test suite, then a short knob sweep and a bench on the small built-in model.
# Results land in ${OUT:-gpu-results}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export MOETUNE_CACHE=${MOETUNE_CACHE:-$out/cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
python -m pytest tests/engine/test_gpu.py tests/engine/test_quant.py -q -rs 2>&1 | tee "$out/tests.txt" | tail -5
engine bench --model builtin:qwen3_moe-small --device cuda --batch 1,32 --prompt-len 128 --new-tokens 32 \
  --repeats 2 --json > "$out/bench.txt" 2>&1; tail -4 "$out/bench.txt"
engine sweep --model builtin:qwen3_moe-small --device cuda --batch 8 --prompt-len 64 --new-tokens 16 \
  --repeats 1 --json > "$out/sweep.txt" 2>&1; tail -25 "$out/sweep.txt" | head -24

#!/usr/bin/env bash
# The simulator's GPU check, as one short script for a machine with an NVIDIA GPU (a few minutes):
# calibrate a profile on this GPU and host, then `engine validate-sim` over the hybrid knobs (resident
# budget 25/50/100 % x host/fetch/auto, int8/int4 experts, replicas, SM share) on the medium built-in
# model, live against simulated. Results land in ${OUT:-gpu-results}/sim/; the last line of
# validate.txt is the JSON with every row and the error summary.
#   bash scripts/gpu_check_sim.sh            # the whole check
#   CONFIGS=6 REQUESTS=8 bash scripts/gpu_check_sim.sh   # shorter
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}/sim
mkdir -p "$out"
export MOETUNE_CACHE=${MOETUNE_CACHE:-$out/../cache}
model=${MODEL:-builtin:qwen3_moe-medium}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
  > "$out/gpu.txt" 2>&1 || { cat "$out/gpu.txt"; exit 1; }
uptime > "$out/uptime.txt"
timeout 300 engine calibrate --out "$out/profile.json" --model "$model" --json > "$out/calibrate.txt" 2>&1
echo "calibrate rc=$?"; tail -14 "$out/calibrate.txt" | head -13
timeout 420 engine validate-sim --model "$model" --workload builtin:chat --profile "$out/profile.json" \
  --grid hybrid --configs "${CONFIGS:-13}" --max-requests "${REQUESTS:-12}" --json > "$out/validate.txt" 2>&1
echo "validate-sim rc=$?"; grep -v '^{' "$out/validate.txt" | grep -v '^validate-sim ' | tail -40
uptime >> "$out/uptime.txt"

#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with an NVIDIA GPU (at most about 11 minutes, 6 where every step ends well), most valuable
# first, each step under its own time limit so that a slow step cannot starve the ones after it:
#   1. the machine (GPU, driver, CPU flags, torch) and `engine doctor` (builds the CPU kernels there);
#   2. every test marked `gpu` (the CUDA paths: tiers, pinned host copies, fetch streams, green
#      contexts, host decode attention, the CUDA int8/int4 kernels);
#   3. `engine bench` on CUDA, medium model, batch 1 and 32: every expert resident, then about half
#      (1.2 of its 2.4 GiB of experts; the missing ones computed on the host or fetched, as `auto` picks);
#   4. where a CUDA decode step's time goes (scripts/decode_profile.py: ops, GPU busy time, launches,
#      implicit syncs by call site);
#   5. a short knob sweep on CUDA.
# Results land in ${OUT:-gpu-results}/ (7 files); steps.txt has the machine, then a line per step with its exit
# status and seconds.
#   bash scripts/gpu_check.sh                 # all steps
#   STEPS="tests bench" bash scripts/gpu_check.sh
# The simulator's check (calibrate on this GPU, then live against simulated) is scripts/gpu_check_sim.sh.
# On this workplace's device machines (no package index there): scripts/gpu_wheels.sh, then its command.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export MOETUNE_CACHE=${MOETUNE_CACHE:-$out/cache}
export PYTHONUNBUFFERED=1
steps=${STEPS:-"machine doctor tests bench bench_half profile sweep"}

step() {  # step NAME LIMIT_S 'COMMAND': run one step if STEPS names it, log its status and seconds
  local name=$1 limit=$2 cmd=$3
  [[ " $steps " == *" $name "* ]] || return 0
  local t0=$SECONDS
  timeout "$limit" bash -c "$cmd"
  local rc=$?
  echo "$name rc=$rc s=$((SECONDS - t0))" | tee -a "$out/steps.txt"
}

machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
  grep -m1 'model name' /proc/cpuinfo; nproc
  grep -o -w 'amx_[a-z0-9]*\|avx512_bf16\|avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
}
export -f machine
export out

step machine 30 'machine > "$out/steps.txt" 2>&1'
step doctor 150 "engine doctor > '$out/doctor.txt' 2>&1"
tail -30 "$out/doctor.txt" 2>/dev/null
step tests 200 "python3 -m pytest tests/engine/test_gpu.py tests/engine/test_quant.py tests/engine/test_ep.py -m gpu -p no:cacheprovider -rfEs --timeout 150 > '$out/tests.txt' 2>&1"
grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed' "$out/tests.txt" 2>/dev/null | tail -40
step bench 90 "engine bench --model builtin:qwen3_moe-medium --device cuda --batch 1,32 \
  --prompt-len 128 --new-tokens 32 --repeats 2 --json > '$out/bench.txt' 2>&1"
tail -6 "$out/bench.txt" 2>/dev/null | cut -c1-400
step bench_half 90 "engine bench --model builtin:qwen3_moe-medium --device cuda --batch 1,32 \
  --prompt-len 128 --new-tokens 32 --repeats 2 --residency static --resident-budget-gib 1.2 --missing-expert auto --json \
  > '$out/bench_half.txt' 2>&1"
tail -6 "$out/bench_half.txt" 2>/dev/null | cut -c1-400
step profile 90 "python3 scripts/decode_profile.py --model builtin:qwen3_moe-medium --batch 1 --steps 10 \
  --threads $(nproc) --rows 30 device=cuda > '$out/profile.txt' 2>&1"
grep -E '^batch|^GPU busy|^implicit|^  ' "$out/profile.txt" 2>/dev/null | head -16
step sweep 90 "engine sweep --model builtin:qwen3_moe-small --device cuda --batch 8 --prompt-len 64 \
  --new-tokens 16 --repeats 1 --json > '$out/sweep.txt' 2>&1"
tail -25 "$out/sweep.txt" 2>/dev/null | head -24 | cut -c1-300
exit 0

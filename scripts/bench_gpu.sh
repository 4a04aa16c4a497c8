#!/usr/bin/env bash
# One prepared single-GPU benchmark (H200): generator decode tok/s vs the bandwidth roofline
# for Qwen2.5-0.5B / 1.5B shapes (random weights) at batch 1/16/64/256, training MFU, weight-sync
# time, the per-phase seconds of a few GRPO steps of a real recipe (generate, reward, logprob,
# train, sync), and decode tok/s next to vLLM's at batch 1/64/256 when vllm is installed
# ("vllm": "not installed" otherwise); one JSON. Budget: under 8 minutes (the RL step and vLLM
# get what is left of --budget-s, each under its own cap). CI runs `--dry-run` (tiny model, CPU).
#
#   bash scripts/bench_gpu.sh [--dry-run] [--out benchmarks/bench_gpu.json] [--compile] [--vllm-eager]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --dry-run "* ]] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench_gpu.sh: no CUDA device visible; use --dry-run on a CPU machine" >&2
  exit 2
fi
# The script stops starting work 30 s before the hard limit, so the JSON is always written.
exec timeout 480 python scripts/bench_gpu.py --budget-s 450 "$@"

#!/usr/bin/env bash
# One prepared single-GPU benchmark (H100 / H200), in one call of under 10 minutes: generator
# decode tok/s vs the bandwidth roofline for Qwen2.5-0.5B / 1.5B shapes (random weights) at batch
# 1/16/64/256 (compiled, the default on CUDA), FlexAttention vs the in-place decode attention it
# replaced, prefill tok/s at 2k and 8k prompts, a long-tail GRPO batch, compile seconds cold and
# warm, training MFU, weight-sync time, the same decode / train / sync entry for an MoE model (two
# Qwen3-30B-A3B layers: 128 experts, top-8; MFU of its active parameters), the per-phase seconds of a few GRPO steps of a real recipe
# with its default config (generate, reward, logprob, train, sync), and decode tok/s next to
# vLLM's when vllm is installed ("vllm": "not installed" otherwise); one JSON with the commit and
# device. The run's compile cache is a fresh folder (cold start), shared by its sections and
# workers. Budget: 540 s (sections start only while enough is left). CI runs `--dry-run`.
#
# `--float8` adds, on a GPU only, the float8 section (under 150 s: past the 10-minute call): a
# compiled bf16 training step of the Qwen2.5-1.5B shape built by titanrl's `build_model`, without
# and with `--float8.enable=true`, printing tokens/s of each and the speedup as one JSON line.
# `--float8-only` runs just that section (about 2 minutes with start-up).
#
# `--long-context` adds, and `--long-context-only` runs alone, the long-sequence section (under
# 240 s): training tokens/s and peak memory of one 32k-token sequence of the Qwen2.5-0.5B shape
# (bf16, full activation checkpointing) with context parallelism over every visible GPU (cp = 1
# on one GPU), one JSON line. With --dry-run: 2 gloo ranks on the CPU, cp = 2, the debug model, 512 tokens.
#
#   bash scripts/bench_gpu.sh [--dry-run] [--out benchmarks/bench_gpu.json] [--eager] [--vllm-eager]
#   bash scripts/bench_gpu.sh --float8-only
#   bash scripts/bench_gpu.sh --long-context-only [--dry-run]
#   bash scripts/bench_gpu.sh --hybrid-only [--dry-run]      # `--hybrid` adds it to a full run
#   bash scripts/bench_gpu.sh --gpt-oss-only [--dry-run]
#   bash scripts/bench_gpu.sh --async-only [--dry-run]       # needs 2 GPUs or more
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --dry-run "* ]] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench_gpu.sh: no CUDA device visible; use --dry-run on a CPU machine" >&2
  exit 2
fi

# Float8 training speed: bf16 vs float8 block linears on the same compiled training step. Never
# on CPU: CPU float8 matmuls are correct (tests/test_float8.py) but not faster.
float8_section() {
  timeout 150 python - <<'PY'
import json

import torch

from benchmarks.harness import timeit
from titanrl.components.model_builder import build_model
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.models.flavors import get_model_args

FLAVOR, BATCH, SEQ, STEPS = "qwen2.5-1.5b", 4, 2048, 6
device = torch.device("cuda")
init_distributed(single_process_group=True)  # FSDP2's bf16 policy needs a (one-rank) mesh
args = get_model_args(FLAVOR)


def tokens_per_s(float8: bool) -> float:
    config = JobConfig()
    config.training.mixed_precision_param = "bfloat16"
    config.compile.enable = True
    config.float8.enable = float8
    with torch.device(device):  # the fresh full state dict is initialised on the GPU: seconds, not minutes
        model = build_model(args, ParallelDims(1, 1, 1, 1), config, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1), device=device)

    def step() -> None:
        logprobs_BT, _ = model.logprobs(tokens[:, :-1], tokens[:, 1:], chunk_tokens=2048)
        (-logprobs_BT.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timeit(step, warmup=2, repeat=STEPS, device=device).median  # warm-up: compilation
    return BATCH * SEQ / seconds


bf16 = tokens_per_s(False)
torch.cuda.empty_cache()  # the bf16 model's blocks back to the device before the float8 one
fp8 = tokens_per_s(True)
print(json.dumps({"float8_bench": {"model": FLAVOR, "batch": BATCH, "seq": SEQ, "bf16_tokens_per_s": round(bf16),
                                   "float8_tokens_per_s": round(fp8), "speedup": round(fp8 / bf16, 3)}}), flush=True)
PY
}

if [[ " $* " == *" --float8-only "* ]]; then
  [[ " $* " == *" --dry-run "* ]] && { echo "bench_gpu.sh: --float8-only needs a GPU (no dry run)" >&2; exit 2; }
  float8_section
  exit $?
fi
# gpt-oss: benchmarks/bench_gpt_oss.py on two gpt-oss-20b-shaped layers (sliding-window + full
# attention with sinks, 32 experts top-4, the real vocabulary): decode tok/s at batch 1 / 64 / 256
# against the bandwidth roofline and training MFU of the active parameters, written to
# benchmarks/bench_gpt_oss_gpu.json (under 300 s). With --dry-run: debug-gpt-oss on the CPU,
# batch 1 / 4, the JSON line printed only.
gpt_oss_section() {
  if [[ " $* " == *" --dry-run "* ]]; then
    OMP_NUM_THREADS=1 timeout 300 python -m benchmarks.bench_gpt_oss --dry-run
  else
    timeout 300 python -m benchmarks.bench_gpt_oss --out benchmarks/bench_gpt_oss_gpu.json
  fi
}
if [[ " $* " == *" --gpt-oss-only "* ]]; then
  gpt_oss_section "$@"
  exit $?
fi
# Long sequences: benchmarks/bench_context_parallel.py --train-step under torchrun, one rank per GPU.
long_context_section() {
  local nproc flavor=qwen2.5-0.5b seq=32768
  nproc=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
  if [[ " $* " == *" --dry-run "* ]]; then nproc=2 flavor=debug seq=512; fi
  OMP_NUM_THREADS=1 timeout 240 python -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    -m benchmarks.bench_context_parallel --train-step --flavor "$flavor" --seq "$seq"
}
if [[ " $* " == *" --long-context-only "* ]]; then
  long_context_section "$@"
  exit $?
fi
# Hybrid linear attention: benchmarks/bench_hybrid_memory.py on two Qwen3.5-shaped layers (gated
# DeltaNet + gated full attention) against two full-attention layers of the same width: generator
# KV and state bytes per sequence and decode tok/s at 1k-16k contexts, written to
# benchmarks/bench_hybrid_memory_gpu.json (under 240 s). With --dry-run: the debug flavors on the
# CPU, 32- and 64-token prompts, rows printed only.
hybrid_section() {
  if [[ " $* " == *" --dry-run "* ]]; then
    OMP_NUM_THREADS=1 timeout 240 python -m benchmarks.bench_hybrid_memory --lengths 32 64 --batch 2 \
      --new-tokens 4 --repeats 1
  else
    timeout 240 python -m benchmarks.bench_hybrid_memory --shape qwen3.5 --device cuda --lengths 1024 4096 16384 \
      --batch 16 --new-tokens 32 --out benchmarks/bench_hybrid_memory_gpu.json
  fi
}
if [[ " $* " == *" --hybrid-only "* ]]; then
  hybrid_section "$@"
  exit $?
fi
# Asynchronous RL (docs/async.md): benchmarks/bench_long_tail.py's long-tailed GRPO workload,
# synchronous vs one-step vs async at max_staleness 1 / 2 / 4, one rank per visible GPU (half
# decode, half train; at least 2 GPUs), written to benchmarks/bench_long_tail_async_gpu.json
# (under 540 s). With --dry-run: 2 gloo ranks on the CPU, 3 steps, the JSON in /tmp.
#   bash scripts/bench_gpu.sh --async-only [--dry-run]
async_section() {
  local nproc steps=20 batch=64 tokens=224 out=benchmarks/bench_long_tail_async_gpu.json
  nproc=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [[ " $* " == *" --dry-run "* ]]; then nproc=2 steps=3 batch=8 tokens=32 out=/tmp/bench_long_tail_async_dry.json; fi
  if (( nproc < 2 )); then echo "bench_gpu.sh: --async-only needs 2 GPUs or more (rollout and trainer ranks)" >&2; return 2; fi
  timeout 540 python -m benchmarks.bench_long_tail --nproc "$nproc" --steps "$steps" --repeats 1 \
    --batch_size "$batch" --group_size 8 --max_new_tokens "$tokens" --sft_steps 4 --eval_freq 0 \
    --modes sync,one_step,async_k1,async_k2,async_k4 --out "$out"
}
if [[ " $* " == *" --async-only "* ]]; then
  async_section "$@"
  exit $?
fi
# Two DeepSeek-V3-shaped layers (benchmarks/bench_deepseek_gpu.py, under 300 s): generator decode
# tok/s at batch 1 / 64 / 256 over MLA's latent cache vs the bandwidth roofline, and training MFU of
# the active parameters; one JSON (--out, default benchmarks/bench_deepseek_gpu.json). With
# --dry-run: the debug-deepseek-v3 flavor on the CPU (tests/test_deepseek_v3.py runs it).
#   bash scripts/bench_gpu.sh --deepseek-only [--dry-run] [--out PATH] [--eager]
if [[ " $* " == *" --deepseek-only "* ]]; then
  ds_args=()
  for arg in "$@"; do [[ "$arg" == "--deepseek-only" ]] || ds_args+=("$arg"); done
  timeout 300 python -m benchmarks.bench_deepseek_gpu ${ds_args[@]+"${ds_args[@]}"}
  exit $?
fi
# The script stops starting work 30 s before the hard limit, so the JSON is always written.
rc=0
args=()
for arg in "$@"; do [[ "$arg" == "--float8" || "$arg" == "--long-context" || "$arg" == "--hybrid" ]] || args+=("$arg"); done
cache_dir="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d -t bench_gpu_compile_cache.XXXXXX)}"
echo "bench_gpu.sh: compile cache $cache_dir (TORCHINDUCTOR_CACHE_DIR=$cache_dir for a warm rerun)" >&2
BENCH_GPU_COMMAND="bash scripts/bench_gpu.sh $*" TORCHINDUCTOR_CACHE_DIR="$cache_dir" \
  timeout 570 python -m benchmarks.bench_gpu --budget-s 540 ${args[@]+"${args[@]}"} || rc=$?
if [[ " $* " == *" --float8 "* && " $* " != *" --dry-run "* ]]; then
  float8_section || echo "bench_gpu.sh: float8 section failed (exit $?)" >&2
fi
if [[ " $* " == *" --long-context "* && " $* " != *" --dry-run "* ]]; then
  long_context_section "$@" || echo "bench_gpu.sh: long-context section failed (exit $?)" >&2
fi
if [[ " $* " == *" --hybrid "* && " $* " != *" --dry-run "* ]]; then
  hybrid_section "$@" || echo "bench_gpu.sh: hybrid section failed (exit $?)" >&2
fi
exit $rc

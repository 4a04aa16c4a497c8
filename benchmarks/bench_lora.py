"""LoRA (lora.enable): how the generator serves base + adapter, optimizer memory, and learning.

- `generator`: the bench model (debug shape, 3.2M params) with rank-16 adapters on all seven
  projections; a 'runtime' generator (adapters applied in its forward) and a 'merged' one
  (W + (alpha / r) B A folded in at every sync) decode greedily, eager and compiled, at batch
  1 / 64 / 256: decode tokens/s = batch * (T - 1) / (time for T tokens - time for 1), the two
  alternating within every repetition; plus each one's weight-sync time from a trainer model
  held apart (no shared storage: what every multi-rank run pays).
- `sync`: weight-sync time on 2 FSDP2 gloo ranks (torchrun, one thread each) for the flavor
  `--sync_flavor` with rank-16 adapters: a runtime generator's first load (the whole base
  all-gathered) vs its later loads (only the adapters: the base is frozen), vs a merged
  generator's load (every load merges and so all-gathers the base).
- `memory`: AdamW state bytes after one step, full fine-tuning vs LoRA ranks 4 / 16 / 64 on the
  bench model (measured), and trainable parameters for a real flavor (meta device, counted).
- `curves`: eval_accuracy of a LoRA run and a full-parameter run of GRPO from the same base,
  read from their metrics.jsonl (commands in README: LoRA).

    python -m benchmarks.bench_lora --out benchmarks/bench_lora.json
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

import torch

from benchmarks.harness import REPO_ROOT, decode_seconds, keep_earlier_sections, timed_call, write_json
from benchmarks.shapes import debug_shape
from titanrl.components.model_builder import build_model
from titanrl.components.optimizer import build_optimizer
from titanrl.config import JobConfig
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.model import LORA_TARGETS
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer
from titanrl.models.flavors import get_model_args
from titanrl.models.lora import LoRALinear, add_lora

BENCH_MODEL = debug_shape()
ONE_RANK = ParallelDims(1, 1, 1, 1)
DOC_TABLES = [
    ("Generator decode tokens/s, runtime adapters vs merged, and weight-sync ms", ["generator", "rows"], None),
    ("Weight sync on 2 FSDP2 ranks", ["sync"], None),
    ("AdamW state, full vs LoRA (bench model)", ["memory", "bench_model"], None),
    ("A real flavor", ["memory", "real_flavor"], None),
    ("Learning: LoRA vs full-parameter GRPO", ["curves"], None),
]


def _lora_config(rank: int, generator: str = "runtime") -> LoRAConfig:
    return LoRAConfig(enable=True, rank=rank, alpha=2.0 * rank, target_modules=list(LORA_TARGETS), generator=generator)


def _trainer(rank: int) -> Transformer:
    config = JobConfig()
    model = build_model(BENCH_MODEL, ONE_RANK, config, torch.device("cpu"), lora=_lora_config(rank))
    with torch.no_grad():  # trained adapters: B no longer zero
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.weight.normal_(0.0, 0.02)
    return model


def _runner(trainer: Transformer, prompts: list[list[int]], mode: str, compile: bool):
    """(run(new_tokens), sync()) for a generator of `mode`, warmed up (and compiled) here."""
    config = GeneratorConfig(block_size=16, num_blocks=4096, max_num_seqs=1024, compile=compile)
    lora = _lora_config(16, mode)
    gen = Generator(BENCH_MODEL, config, torch.device("cpu"), lora=lora if mode == "runtime" else None)
    gen.load_weights(trainer)

    def run(new_tokens: int) -> None:
        gen.allocator.reset_prefix_cache()
        completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0))
        assert all(len(c.token_ids) == new_tokens for c in completions)

    run(8)
    run(8)
    return run, functools.partial(gen.load_weights, trainer)


def bench_generator(batch_sizes: list[int], prompt_len: int, new_tokens: int, reps: int) -> list[dict]:
    torch.manual_seed(0)
    trainer = _trainer(16)
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(0, 256, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
        per_run, sync = {}, {}
        eager = {mode: _runner(trainer, prompts, mode, False) for mode in ("runtime", "merged")}
        for _ in range(reps):
            for mode, (run, do_sync) in eager.items():
                per_run.setdefault(f"{mode}_eager", []).append(decode_seconds(run, new_tokens))
                sync.setdefault(mode, []).append(timed_call(do_sync)[0])
        for mode in ("runtime", "merged"):
            # The compiled decode step skips guards on modules, so its graphs are shared by every
            # Generator of a process: one at a time, each after a reset.
            torch._dynamo.reset()
            run, _ = _runner(trainer, prompts, mode, True)
            per_run[f"{mode}_compiled"] = [decode_seconds(run, new_tokens) for _ in range(reps)]
        row = {"batch": batch}
        for key, times in per_run.items():
            row[f"{key}_tok_s"] = batch * (new_tokens - 1) / statistics.median(times)
        for suffix in ("eager", "compiled"):
            row[f"merged_vs_runtime_{suffix}"] = row[f"merged_{suffix}_tok_s"] / row[f"runtime_{suffix}_tok_s"]
        for mode, times in sync.items():
            row[f"{mode}_sync_ms"] = 1e3 * statistics.median(times)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _load_times(gen: Generator, trainer: Transformer, n: int) -> list[float]:
    """Seconds of `n` weight syncs into `gen`, every rank starting each one together."""
    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        times.append(timed_call(functools.partial(gen.load_weights, trainer))[0])
    return times


def sync_worker(flavor: str, reps: int, out: str) -> None:
    """One rank of the `sync` section (under torchrun)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = get_model_args(flavor)
    dims = ParallelDims(1, world, 1, world)
    trainer = build_model(args, dims, JobConfig(), torch.device("cpu"), lora=_lora_config(16))
    row = {"flavor": flavor, "ranks": world}
    for mode in ("runtime", "merged"):
        gen = Generator(
            args,
            GeneratorConfig(block_size=16, num_blocks=8),
            torch.device("cpu"),
            lora=_lora_config(16, mode) if mode == "runtime" else None,
        )
        times = _load_times(gen, trainer, reps + 1)
        row[f"{mode}_first_load_s"] = times[0]
        row[f"{mode}_load_s"] = statistics.median(times[1:])
    row["runtime_later_vs_merged"] = row["merged_load_s"] / row["runtime_load_s"]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def bench_sync(flavor: str, reps: int) -> dict:
    out = f"/tmp/bench_lora_sync_{os.getpid()}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "benchmarks.bench_lora",
        "--sync_worker",
        "--sync_flavor",
        flavor,
        "--reps",
        str(reps),
        "--out",
        out,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT)
    with open(out) as f:
        row = json.load(f)
    print(json.dumps(row), flush=True)
    return row


def _adam_state_bytes(model: Transformer) -> int:
    optimizer = build_optimizer(model, JobConfig().optimizer)
    model(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")


def bench_memory(ranks: list[int], flavor: str) -> dict:
    torch.manual_seed(0)
    full = build_model(BENCH_MODEL, ONE_RANK, JobConfig(), torch.device("cpu"))
    rows = [
        {
            "what": "full",
            "trainable_params": sum(p.numel() for p in full.parameters()),
            "adam_state_MB": _adam_state_bytes(full) / 1e6,
        }
    ]
    for rank in ranks:
        model = build_model(BENCH_MODEL, ONE_RANK, JobConfig(), torch.device("cpu"), lora=_lora_config(rank))
        rows.append(
            {
                "what": f"lora_r{rank}",
                "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "adam_state_MB": _adam_state_bytes(model) / 1e6,
            }
        )
    for row in rows:
        row["adam_state_vs_full"] = row["adam_state_MB"] / rows[0]["adam_state_MB"]
        print(json.dumps(row), flush=True)
    with torch.device("meta"):
        real = Transformer(get_model_args(flavor))
        total = sum(p.numel() for p in real.parameters())
        add_lora(real, _lora_config(16))
    adapters = sum(p.numel() for n, p in real.named_parameters() if ".lora_" in n)
    return {
        "bench_model": rows,
        "real_flavor": {
            "flavor": flavor,
            "params": total,
            "lora_r16_all_params": adapters,
            "adam_state_full_GB": 8 * total / 1e9,
            "adam_state_lora_r16_GB": 8 * adapters / 1e9,
        },
    }


def _read_run(folder: str) -> dict:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl = [r for r in rows if r.get("phase") == "rl"]
    steps = [r for r in rl if "reward_mean" in r]
    return {
        "folder": folder,
        "eval_accuracy": {r["step"]: r["eval_accuracy"] for r in rl if "eval_accuracy" in r},
        "reward_first10": statistics.mean(r["reward_mean"] for r in steps[:10]),
        "reward_last10": statistics.mean(r["reward_mean"] for r in steps[-10:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_lora.json")
    parser.add_argument("--batch_sizes", default="1,64,256")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ranks", default="4,16,64")
    parser.add_argument("--flavor", default="qwen2.5-7b")
    parser.add_argument("--lora_run", default="/tmp/runs/lora_rl2")
    parser.add_argument("--full_run", default="/tmp/runs/full_rl2")
    parser.add_argument("--sync_flavor", default="qwen2.5-0.5b")
    parser.add_argument("--sync_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="generator,sync,memory,curves")
    args = parser.parse_args()
    if args.sync_worker:
        return sync_worker(args.sync_flavor, args.reps, args.out)
    sections = args.sections.split(",")
    report = keep_earlier_sections(args.out, sections, ("generator", "sync", "memory", "curves"))
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "sync_worker")}
    if "generator" in sections:
        report["generator"] = {
            "lora_rank": 16,
            "targets": list(LORA_TARGETS),
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "rows": bench_generator(
                [int(b) for b in args.batch_sizes.split(",")], args.prompt_len, args.new_tokens, args.reps
            ),
        }
    if "sync" in sections:
        report["sync"] = bench_sync(args.sync_flavor, args.reps)
    if "memory" in sections:
        report["memory"] = bench_memory([int(r) for r in args.ranks.split(",")], args.flavor)
    if "curves" in sections:
        report["curves"] = {"lora": _read_run(args.lora_run), "full": _read_run(args.full_run)}
    write_json(args.out, report)


if __name__ == "__main__":
    main()

"""Quantised rollout (generator.quantize): decode speed, weight memory and learning, side by side.

- `decode`: the bench model (debug shape, 3.2M params) decodes greedily with the same weights as
  an fp32, a bf16 and an int8 (weight-only, fp32 activations) generator, eager and compiled, at
  batch 1 / 64 / 256; decode tokens/s = batch * (T - 1) / (time for T tokens - time for 1), the
  variants alternating within every repetition. Ratios are against fp32 of the same mode.
- `memory`: weight bytes of the generator for real flavors (built on the meta device, nothing
  allocated): fp32, bf16, and int8 with fp32 / bf16 embedding and head.
- `curves`: eval_accuracy at steps 20..120 and the mean sampler/trainer mismatch of two runs of
  the main job (train_configs/grpo_reverse_debug.toml), read from their metrics.jsonl:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 -m titanrl.train \\
        --job.config_file train_configs/grpo_reverse_debug.toml --job.dump_folder /tmp/fp32_run
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 -m titanrl.train \\
        --job.config_file train_configs/grpo_reverse_debug.toml --generator.quantize=int8 \\
        --algorithm.off_policy_correction=tis --job.dump_folder /tmp/int8_run

    python -m benchmarks.bench_quant_rollout --out benchmarks/bench_quant_rollout.json
"""

import argparse
import json
import os
import statistics

import torch

from benchmarks.harness import decode_seconds, keep_earlier_sections, write_json
from benchmarks.shapes import debug_shape
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.generator.quantize import WeightQuantizer
from titanrl.generator.weight_sync import weight_bytes
from titanrl.models import Transformer
from titanrl.models.flavors import get_model_args

BENCH_MODEL = debug_shape()
VARIANTS = {"fp32": (torch.float32, "none"), "bf16": (torch.bfloat16, "none"), "int8": (torch.float32, "int8")}
MISMATCH = ("gen_logprob_diff", "mismatch_kl", "mismatch_ratio_max", "is_dropped_frac")
DOC_TABLES = [
    ("Decode tokens/s and ratio to fp32", ["decode", "rows"], None),
    ("Generator weight MB", ["memory"], None),
    ("Eval accuracy, fp32 vs int8 rollouts (with TIS)", ["curves", "eval_accuracy_table"], None),
]


def _runner(model: Transformer, prompts: list[list[int]], dtype: torch.dtype, quantize: str, compile: bool):
    """`run(new_tokens)`: greedy generation of `prompts`, warmed up (and compiled) here."""
    config = GeneratorConfig(block_size=16, num_blocks=4096, max_num_seqs=1024, compile=compile, quantize=quantize)
    gen = Generator(model.args, config, torch.device("cpu"), dtype=dtype)
    gen.load_weights(model)

    def run(new_tokens: int) -> None:
        gen.allocator.reset_prefix_cache()
        completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0))
        assert all(len(c.token_ids) == new_tokens for c in completions)

    run(8)
    run(8)
    return run


def bench_decode(batch_sizes: list[int], prompt_len: int, new_tokens: int, reps: int) -> list[dict]:
    torch.manual_seed(0)
    model = Transformer(BENCH_MODEL)
    model.init_weights()
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(0, 256, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
        per_run = {}
        # Eager variants alternate within every repetition.
        runners = {
            f"{name}_eager": _runner(model, prompts, dtype, quantize, False)
            for name, (dtype, quantize) in VARIANTS.items()
        }
        for _ in range(reps):
            for key, run in runners.items():
                per_run.setdefault(key, []).append(decode_seconds(run, new_tokens))
        # Compiled ones one at a time: the decode step skips guards on modules, so its compiled
        # graphs are shared by every Generator of the process (one per job): reset in between.
        for name, (dtype, quantize) in VARIANTS.items():
            torch._dynamo.reset()
            run = _runner(model, prompts, dtype, quantize, True)
            per_run[f"{name}_compiled"] = [decode_seconds(run, new_tokens) for _ in range(reps)]
        row = {"batch": batch}
        for key, times in per_run.items():
            row[f"{key}_tok_s"] = batch * (new_tokens - 1) / statistics.median(times)
        for key in per_run:
            row[f"{key}_vs_fp32"] = row[f"{key}_tok_s"] / row[f"fp32_{key.split('_')[1]}_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_memory(flavors: list[str]) -> list[dict]:
    """Generator weight bytes per precision, on the meta device."""
    rows = []
    for flavor in flavors:
        row = {"flavor": flavor}
        for name, dtype, quantize in (
            ("fp32", torch.float32, False),
            ("bf16", torch.bfloat16, False),
            ("int8_fp32", torch.float32, True),
            ("int8_bf16", torch.bfloat16, True),
        ):
            with torch.device("meta"):
                model = Transformer(get_model_args(flavor)).to(dtype)
            if quantize:
                WeightQuantizer("int8", torch.device("cpu"), dtype).quantize_model_(model)
            row[f"{name}_MB"] = weight_bytes(model) / 1e6
        row["int8_fp32_vs_fp32"] = row["int8_fp32_MB"] / row["fp32_MB"]
        row["int8_bf16_vs_bf16"] = row["int8_bf16_MB"] / row["bf16_MB"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _read_run(folder: str) -> dict:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl = [r for r in rows if r.get("phase") == "rl"]
    evals = {r["step"]: r["eval_accuracy"] for r in rl if "eval_accuracy" in r}
    steps = [r for r in rl if "gen_logprob_diff" in r]
    out = {
        "folder": folder,
        "eval_accuracy": evals,
        "train_steps": len(steps),
        "final_train_accuracy_last10": statistics.mean(r["accuracy"] for r in steps[-10:]) if steps else None,
        "seconds": rl[-1]["time"] - rl[0]["time"] if rl else None,
    }
    for key in MISMATCH:
        values = [r[key] for r in steps if key in r]
        if values:
            out[f"mean_{key}"] = statistics.mean(values)
    out["mean_time_generate_s"] = statistics.mean(r["time_generate"] for r in steps if "time_generate" in r)
    return out


def bench_curves(fp32_run: str, int8_run: str) -> dict:
    runs = {"fp32": _read_run(fp32_run), "int8_tis": _read_run(int8_run)}
    steps = sorted(set(runs["fp32"]["eval_accuracy"]) & set(runs["int8_tis"]["eval_accuracy"]))
    table = [
        {"step": s, "fp32": runs["fp32"]["eval_accuracy"][s], "int8_tis": runs["int8_tis"]["eval_accuracy"][s]}
        for s in steps
    ]
    for row in table:
        print(json.dumps(row), flush=True)
    return {**runs, "eval_accuracy_table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_quant_rollout.json")
    parser.add_argument("--batch_sizes", default="1,64,256")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--flavors", default="qwen2.5-0.5b,qwen2.5-7b")
    parser.add_argument("--fp32_run", default="/tmp/fp32_run")
    parser.add_argument("--int8_run", default="/tmp/int8_run")
    parser.add_argument("--sections", default="decode,memory,curves")
    args = parser.parse_args()
    sections = args.sections.split(",")
    report = keep_earlier_sections(args.out, sections, ("decode", "memory", "curves"))
    report["config"] = {k: v for k, v in vars(args).items() if k != "out"}  # defaults included
    if "decode" in sections:
        report["decode"] = {
            "model_params_M": 3.2,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "rows": bench_decode(
                [int(b) for b in args.batch_sizes.split(",")], args.prompt_len, args.new_tokens, args.reps
            ),
        }
    if "memory" in sections:
        report["memory"] = bench_memory(args.flavors.split(","))
    if "curves" in sections:
        report["curves"] = bench_curves(args.fp32_run, args.int8_run)
    write_json(args.out, report)


if __name__ == "__main__":
    main()

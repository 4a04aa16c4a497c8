"""GRPO at a real vocabulary (151,936 ids): titanrl vs TRL's GRPOTrainer, step time and peak memory.

    python -m benchmarks.bench_real_vocab --setup-trl                  # once: a venv with CPU torch + trl
    python -m benchmarks.bench_real_vocab --trl-python /work/trl_venv/bin/python \\
        --out benchmarks/bench_real_vocab.json                         # titanrl vs TRL, alternating runs
    python -m benchmarks.bench_real_vocab --flavor qwen2.5-0.5b \\
        --out benchmarks/bench_real_vocab_flavor.json                  # titanrl alone, the real 0.5B shape

Everything is written here, in a temporary folder: a random-weight Qwen2.5-shaped checkpoint (2
layers at Qwen2.5-0.5B's width: dim 896, 14 heads, 2 KV heads, hidden 4864, q/k/v biases, tied
embeddings, vocabulary 151,936) exported by titanrl as HF safetensors; a byte-level BPE
`tokenizer.json` trained here with Qwen2's pre-tokenizer, laid out like Qwen2.5's (BPE tokens from
id 0, <|endoftext|> / <|im_start|> / <|im_end|> at 151643-151645, reserved tokens up to 151,935)
and the ChatML template in `tokenizer_config.json`; GSM8K-like word problems whose answers follow
'####'. Both sides render the same prompts through the same template (the script checks that the
token ids agree), sample `group_size` completions of at most `max_new_tokens` tokens at temperature
1.0 per prompt, score them with a GSM8K verifier (titanrl: `titanrl.rewards.math_verify:
gsm8k_verifier` in its reward workers; TRL: the same '####'-then-last-number rule in-process), and
take one AdamW step per generation batch (same lr, betas, eps, weight decay 0, clip 1.0) on the
token-mean (DAPO) clipped loss (0.2 / 0.28), no KL, float32 on CPU, `--threads` threads.

titanrl runs `python -m titanrl.train` (the `grpo_qwen2.5_0.5b_gsm8k.toml` recipe with CLI
overrides) from this checkout (PYTHONPATH = repo root); TRL runs in its own virtual environment.
Runs alternate (titanrl, TRL) `--repeats` times. Step time: the median over each run's steps
after the first (warm-up); titanrl's is the wall time between consecutive metrics rows (the last
step, which also runs the final evaluation, is left out), per phase from its metrics; TRL's is
`on_step_begin` to `on_step_end`, split into generate+score and forward / backward+optimizer.
Peak memory: the trainer process's max RSS from `os.wait4` (Linux reports the max, not the sum,
over the process and its reaped children: titanrl's spawned reward workers are small separate
processes and do not set it), and the peak of the sampled RSS summed over the process tree
(`tree`, which does count the reward workers).

`--flavor qwen2.5-0.5b`: titanrl alone on the full 24-layer flavor with random weights, reported
against the floor of weights + gradients + AdamW's two moments (4 float32 copies of the parameters;
on one float32 rank the generator uses the trainer's own weights, so it adds no copy).
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

from benchmarks.bench_rl_step import DEFAULT_VENV, setup_trl
from benchmarks.harness import REPO_ROOT, environment, run_measured, write_json
from benchmarks.real_vocab_assets import (
    INSTRUCTION,
    SYSTEM_PROMPT,
    VOCAB_SIZE,
    make_problems,
    titanrl_prompt_ids,
    write_checkpoint,
    write_prompts,
    write_tokenizer,
)
from benchmarks.real_vocab_trl import run_trl

DOC_TABLES = [
    (
        "titanrl vs TRL, medians over repeats",
        ["summary"],
        ["step_s", "phase_sum_s", "max_rss_gb", "sampled_peak_tree_rss_gb", "response_len"],
    ),
    ("Ratios", ["ratios"], None),
    ("Median seconds per phase", ["summary", "*", "phases_s"], None),
    (
        "titanrl alone on the full flavor: step and peak memory",
        ["run"],
        ["step_s", "phase_sum_s", "max_rss_gb", "phases_s.*"],
    ),
    ("Against the floor of 4 float32 copies of the parameters", ["floor"], None),
    ("Peak and resident memory over the floor", ["*_over_floor|resident_*|peak_beyond_*"], None),
]


# ---- the two sides ----


def titanrl_command(a, model: str, jsonl: str, dump: str) -> list[str]:
    """`python -m titanrl.train` on the GSM8K recipe with the compared settings."""
    max_prompt = 160
    num_blocks = 2 * a.batch_size * a.group_size * math.ceil((max_prompt + a.max_new_tokens) / 16)
    model_opts = (
        [f"--model.flavor={a.flavor}", f"--model.tokenizer={model}", "--model.hf_checkpoint="]
        if a.flavor
        else [f"--model.hf_checkpoint={model}", f"--model.tokenizer={model}"]
    )
    return [
        sys.executable,
        "-m",
        "titanrl.train",
        "--job.config_file",
        os.path.join(REPO_ROOT, "train_configs", "grpo_qwen2.5_0.5b_gsm8k.toml"),
        f"--job.dump_folder={dump}",
        *model_opts,
        "--model.max_seq_len=512",
        "--sft_warmup.steps=0",
        f"--training.steps={a.steps}",
        f"--training.batch_size={a.batch_size}",
        f"--algorithm.group_size={a.group_size}",
        "--algorithm.kl_coef=0.0",
        "--algorithm.loss_agg=token-mean",
        f"--generator.max_new_tokens={a.max_new_tokens}",
        "--generator.temperature=1.0",
        f"--generator.num_blocks={num_blocks}",
        f"--data.path={jsonl}",
        "--data.chat_template=true",
        "--data.num_eval_samples=1",
        "--metrics.eval_freq=0",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
        f"--optimizer.lr={a.lr}",
        "--optimizer.beta1=0.9",
        f"--optimizer.beta2={a.beta2}",
        "--optimizer.eps=1e-8",
        "--optimizer.weight_decay=0.0",
        "--lr_scheduler.warmup_steps=0",
        "--training.max_norm=1.0",
        "--training.mixed_precision_param=float32",
        "--training.mixed_precision_reduce=float32",
        "--reward.function=titanrl.rewards.math_verify:gsm8k_verifier",
        f"--reward.num_workers={a.reward_workers}",
        f"--activation_checkpoint.mode={'full' if a.activation_checkpointing else 'none'}",
        "--job.print_config=false",
        *a.titanrl_override,
    ]


def run_titanrl(a, model: str, jsonl: str, workdir: str, tag: str) -> dict:
    dump = tempfile.mkdtemp(prefix=f"titanrl_{tag}_", dir=workdir)
    cmd = titanrl_command(a, model, jsonl, dump)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"}
    mem = run_measured(cmd, env, os.path.join(dump, "log.txt"))
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    rows = [r for r in rows if "reward_mean" in r]
    walls = [b["time"] - p["time"] for p, b in zip(rows, rows[1:])][:-1]  # the last step also evaluates
    kept = rows[1:]  # the first step (warm-up) is dropped
    phases = ["sync", "generate", "reward", "logprob", "train"]
    return {
        "step_s": statistics.median(walls) if walls else float("nan"),
        "phase_sum_s": statistics.median(sum(r.get(f"time_{p}", 0.0) for p in phases) for r in kept),
        "phases_s": {p: statistics.median(r.get(f"time_{p}", 0.0) for r in kept) for p in phases},
        "rss_at_phase_end_gb": {p: max(r.get(f"mem_{p}_gb", 0.0) for r in rows) for p in phases},
        "peak_mem_gb_by_step": [r.get("peak_mem_gb") for r in rows],
        "response_len": statistics.mean(r["response_len"] for r in rows),
        "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
        "grad_norm": [r.get("grad_norm") for r in rows],
        "gen_logprob_diff": [r.get("gen_logprob_diff") for r in rows],
        **mem,
    }


# ---- the report ----


def summarize(runs: list[dict], keys: list[str]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["phases_s"] = {p: statistics.median(r["phases_s"][p] for r in runs) for p in runs[0]["phases_s"]}
    return out


def compare(a, workdir: str, model: str, n_params: int, problems: list[tuple[str, str]]) -> dict:
    jsonl, trl_json = write_prompts(workdir, problems)
    runs: dict[str, list[dict]] = {"titanrl": [], "trl": []}
    for rep in range(a.repeats):
        runs["titanrl"].append(run_titanrl(a, model, jsonl, workdir, f"r{rep}"))
        runs["trl"].append(run_trl(a, model, trl_json, workdir))
        print(
            f"repeat {rep + 1}/{a.repeats}: "
            + ", ".join(
                f"{k} {v[-1]['step_s']:.3f} s/step, max RSS {v[-1]['max_rss_gb']:.2f} GiB" for k, v in runs.items()
            ),
            flush=True,
        )
    keys = ["step_s", "max_rss_gb", "sampled_peak_tree_rss_gb", "response_len"]
    summary = {k: summarize(v, keys) for k, v in runs.items()}
    summary["titanrl"]["phase_sum_s"] = statistics.median(r["phase_sum_s"] for r in runs["titanrl"])
    ratios = {
        "step_time_titanrl_over_trl": summary["titanrl"]["step_s"] / summary["trl"]["step_s"],
        "peak_rss_titanrl_over_trl": summary["titanrl"]["max_rss_gb"] / summary["trl"]["max_rss_gb"],
        "peak_tree_rss_titanrl_over_trl": (
            summary["titanrl"]["sampled_peak_tree_rss_gb"] / summary["trl"]["sampled_peak_tree_rss_gb"]
        ),
    }
    titan_ids = titanrl_prompt_ids(model, problems[:1])[0]
    trl_run = runs["trl"][0]
    prompts = {
        "titanrl_mean_prompt_tokens": statistics.mean(len(x) for x in titanrl_prompt_ids(model, problems)),
        "trl_mean_prompt_tokens_seen": trl_run["prompt_len"],
        "first_prompt_ids_identical": titan_ids == trl_run["first_prompt_ids"],
    }
    for r in runs["trl"]:
        r.pop("first_prompt_ids")
    return {
        "summary": summary,
        "ratios": ratios,
        "prompts": prompts,
        "runs": runs,
        "trl_versions": trl_run["versions"],
        "params": n_params,
    }


def flavor_report(a, workdir: str, model_folder: str, problems: list[tuple[str, str]]) -> dict:
    """titanrl alone at the full flavor: peak RSS vs 4 float32 copies of the parameters."""
    import torch

    from titanrl.models.flavors import get_model_args
    from titanrl.models.model import Transformer

    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(get_model_args(a.flavor)).parameters())
    jsonl, _ = write_prompts(workdir, problems)
    run = run_titanrl(a, model_folder, jsonl, workdir, a.flavor)
    copy_gb = n_params * 4 / 2**30
    floor = {
        "params": n_params,
        "one_fp32_copy_gb": copy_gb,
        "floor_4_copies_gb": 4 * copy_gb,
        "with_a_generator_copy_gb": 5 * copy_gb,
    }
    # Between steps (end of the weight sync) weights, last step's gradients and AdamW's moments are
    # resident: what is there beyond those 4 copies is the runtime, the generator's own weights if
    # it holds a copy, and allocator caches; the peak adds the training step's transients.
    resident = run["rss_at_phase_end_gb"]["sync"]
    return {
        "run": run,
        "floor": floor,
        "peak_over_floor": run["max_rss_gb"] / (4 * copy_gb),
        "resident_between_steps_gb": resident,
        "resident_beyond_floor_gb": resident - 4 * copy_gb,
        "peak_beyond_resident_gb": run["max_rss_gb"] - resident,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup-trl", action="store_true", help="create the TRL venv (at --venv) and exit")
    p.add_argument("--venv", default=DEFAULT_VENV)
    p.add_argument("--trl-python", default="", help="python of a venv with trl (default: <venv>/bin/python)")
    p.add_argument("--flavor", default="", help="titanrl alone on this model flavor (e.g. qwen2.5-0.5b), no TRL")
    p.add_argument("--n-layers", type=int, default=2, help="layers of the compared checkpoint")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per step (default 4)")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt (default 8; flavor 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32; flavor 64")
    p.add_argument("--steps", type=int, default=None, help="steps per run, the first dropped (default 4; flavor 3)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--reward-workers", type=int, default=1, help="titanrl reward worker processes")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="full activation checkpointing on both sides (TRL's GRPOConfig default; off here)",
    )
    p.add_argument(
        "--titanrl-override",
        action="append",
        default=[],
        help="extra titanrl CLI override, e.g. --titanrl-override=--training.logprob_chunk_tokens=256",
    )
    p.add_argument("--bpe-vocab", type=int, default=4000, help="BPE tokens trained before padding to 151,936")
    p.add_argument("--out", default="")
    a = p.parse_args()
    defaults = {
        "batch_size": 4,
        "group_size": 4 if a.flavor else 8,
        "max_new_tokens": 64 if a.flavor else 32,
        "steps": 3 if a.flavor else 4,
    }
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def run_config(a: argparse.Namespace) -> dict:
    """The settings both sides run with, as the report records them."""
    optimizer = {
        "name": "AdamW, fused (titanrl's recipe; TRL's default adamw_torch_fused)",
        "lr": a.lr,
        "betas": [0.9, a.beta2],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "lr_schedule": "constant",
    }
    return {
        "prompts_per_step": a.batch_size,
        "group_size": a.group_size,
        "max_new_tokens": a.max_new_tokens,
        "temperature": 1.0,
        "steps_per_run": a.steps,
        "steps_dropped": 1,
        "threads": a.threads,
        "dtype": "float32",
        "optimizer": optimizer,
        "loss": "token-mean (TRL loss_type='dapo'), clip 0.2 / 0.28, no KL (beta 0), 1 update per batch",
        "activation_checkpointing": a.activation_checkpointing,
        "titanrl_reward_workers": a.reward_workers,
        "titanrl_overrides": a.titanrl_override,
        "vocab_size": VOCAB_SIZE,
        "bpe_tokens": a.bpe_vocab,
    }


def main() -> None:
    a = parse_args()
    if a.setup_trl:
        setup_trl(a.venv)
        return
    if not a.flavor:
        a.trl_python = a.trl_python or os.path.join(a.venv, "bin", "python")
        if not os.path.exists(a.trl_python):
            raise SystemExit(f"no TRL venv at {a.venv}: run with --setup-trl first (or pass --trl-python)")
    env = environment()  # the code the runs import (main may move while they run)
    workdir = tempfile.mkdtemp(prefix="bench_real_vocab_")
    folder = os.path.join(workdir, "model")
    os.makedirs(folder)
    problems = make_problems(max(256, a.batch_size * a.steps + 1), seed=0)
    corpus = [SYSTEM_PROMPT, INSTRUCTION, *(q for q, _ in make_problems(2000, seed=1))]
    write_tokenizer(folder, corpus, a.bpe_vocab)
    config = run_config(a)
    report = {
        "benchmark": (
            "GRPO at a real vocabulary: titanrl alone on a full flavor"
            if a.flavor
            else "GRPO at a real vocabulary: titanrl vs TRL GRPOTrainer (CPU)"
        ),
        "peak_memory": (
            "max RSS of the trainer process from os.wait4 (the max, not the sum, over it and its reaped "
            "children); 'sampled_peak_tree_rss_gb' sums the sampled RSS of the whole process tree, "
            "titanrl's reward worker processes included"
        ),
    }
    if a.flavor:
        config["model"] = f"titanrl flavor {a.flavor}, random weights, vocabulary {VOCAB_SIZE}"
        report.update(config=config, **flavor_report(a, workdir, folder, problems))
        print(
            json.dumps(
                {
                    k: report[k]
                    for k in (
                        "floor",
                        "peak_over_floor",
                        "resident_between_steps_gb",
                        "resident_beyond_floor_gb",
                        "peak_beyond_resident_gb",
                    )
                },
                indent=2,
            )
        )
    else:
        n_params = write_checkpoint(folder, a.n_layers, seed=0)
        config["model"] = (
            f"Qwen2.5-0.5B width (dim 896, 14 heads, 2 KV heads, hidden 4864, qkv bias, tied "
            f"embeddings), {a.n_layers} layers, vocabulary {VOCAB_SIZE}, random weights"
        )
        result = compare(a, workdir, folder, n_params, problems)
        report.update(config=config, **result)
        print(json.dumps({k: result[k] for k in ("summary", "ratios", "prompts")}, indent=2))
    if a.out:
        write_json(a.out, report, env=env)


if __name__ == "__main__":
    main()

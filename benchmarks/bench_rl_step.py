"""One GRPO step, titanrl vs TRL's GRPOTrainer, same model, data and shapes, in one run.

    python -m benchmarks.bench_rl_step --setup-trl              # once: a venv with CPU torch + trl
    python -m benchmarks.bench_rl_step --out benchmarks/bench_rl_step.json

Both sides load the same random-weight Qwen3-shaped model (HF safetensors) and the same
character-level tokenizer written here, train on the same reverse-task prompts with the same
batch (prompts x group size), completion length, sampling temperature, clip range and token-mean
loss, one optimizer step per generation batch, no KL. Runs alternate (titanrl eager, titanrl
compiled, TRL) for several repetitions; the first step of each run (warm-up, compilation) is
dropped and the median step time over the rest is reported, per phase where the framework
exposes it. TRL runs in its own virtual environment (it is not a titanrl dependency).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import REPO_ROOT, environment, write_json

DEFAULT_VENV = os.path.expanduser("~/.cache/titanrl/trl_venv")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789:=+-*,. "
DOC_TABLES = [
    ("Median step seconds", ["summary"], ["median_step_s"]),
    ("Median seconds per phase", ["summary", "*", "median_phases_s"], None),
    ("TRL step time over titanrl's", ["ratios"], None),
]

TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
rows = json.load(open(cfg["prompts"]))
dataset = Dataset.from_list(rows)

def reward(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

class Timer(TrainerCallback):
    def __init__(self):
        self.steps, self.start = [], None
    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.steps.append(time.perf_counter() - self.start)

n_completions = cfg["batch_size"] * cfg["group_size"]
args = GRPOConfig(
    output_dir=cfg["workdir"] + "/trl_out", per_device_train_batch_size=n_completions,
    gradient_accumulation_steps=1, num_generations=cfg["group_size"],
    max_completion_length=cfg["max_new_tokens"], temperature=1.0, learning_rate=cfg["lr"], beta=0.0,
    epsilon=0.2, epsilon_high=0.28, loss_type="dapo", max_steps=cfg["steps"], logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0, shuffle_dataset=False,
    max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    adam_beta2=0.99, dataloader_num_workers=0,
)
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=reward, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
gen_times = []
inner = trainer._generate_and_score_completions
def timed(*a, **kw):
    t0 = time.perf_counter()
    out = inner(*a, **kw)
    gen_times.append(time.perf_counter() - t0)
    return out
trainer._generate_and_score_completions = timed
timer = Timer()
trainer.add_callback(timer)
trainer.train()
json.dump({"step_s": timer.steps, "generate_score_s": gen_times}, open(cfg["result"], "w"))
"""


def make_assets(workdir: str, n_prompts: int, seed: int) -> tuple[str, str]:
    """A char-level HF tokenizer + random Qwen3-shaped model folder, and a prompt file."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from benchmarks.shapes import debug_shape
    from titanrl.data.tasks import Reverse
    from titanrl.models.hf import export_hf
    from titanrl.models.model import Transformer

    folder = os.path.join(workdir, "model")
    specials = ["<pad>", "<bos>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.add_special_tokens(specials)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "padding_side": "left",
                "model_max_length": 256,
            },
            f,
        )
    # The debug flavor's shape (Qwen3, 4 layers, dim 256) with this vocabulary.
    args = debug_shape(vocab_size=64, max_seq_len=256)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    export_hf(model, folder)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=2)
    rng = random.Random(seed)
    samples = [Reverse().make(rng) for _ in range(n_prompts)]
    prompts = os.path.join(workdir, "prompts.json")
    json.dump([{"prompt": s.prompt, "answer": s.answer} for s in samples], open(prompts, "w"))
    jsonl = os.path.join(workdir, "prompts.jsonl")
    with open(jsonl, "w") as f:
        for s in samples:
            f.write(json.dumps({"prompt": s.prompt, "answer": s.answer}) + "\n")
    return folder, jsonl


def run_titanrl(a, model: str, jsonl: str, workdir: str, compiled: bool) -> dict:
    dump = tempfile.mkdtemp(dir=workdir)
    cmd = [
        sys.executable,
        "-m",
        "titanrl.train",
        "--job.config_file",
        os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml"),
        f"--job.dump_folder={dump}",
        f"--model.hf_checkpoint={model}",
        f"--model.tokenizer={model}",
        "--sft_warmup.steps=0",
        f"--training.steps={a.steps}",
        f"--training.batch_size={a.batch_size}",
        f"--algorithm.group_size={a.group_size}",
        f"--generator.max_new_tokens={a.max_new_tokens}",
        f"--data.path={jsonl}",
        "--data.num_eval_samples=1",
        "--metrics.eval_freq=0",
        f"--optimizer.lr={a.lr}",
        "--reward.num_workers=1",
        "--job.print_config=false",
    ]
    if compiled is not None:  # None: the recipe's own settings (the generator compiles on CUDA)
        cmd += [f"--compile.enable={str(compiled).lower()}", f"--generator.compile={str(compiled).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode:
        raise RuntimeError(f"titanrl run failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    steps = [s for s in steps if s.get("phase") == "rl" and "reward_mean" in s][1:]  # drop warm-up step
    phases = ["sync", "generate", "reward", "logprob", "train"]
    per_phase = {p: statistics.median(s.get(f"time_{p}", 0.0) for s in steps) for p in phases}
    return {
        "step_s": statistics.median(sum(s.get(f"time_{p}", 0.0) for p in phases) for s in steps),
        "phases_s": per_phase,
        "response_len": statistics.mean(s["response_len"] for s in steps),
    }


def run_trl(a, model: str, workdir: str) -> dict:
    result = os.path.join(workdir, f"trl_{time.monotonic_ns()}.json")
    cfg = {
        "model": model,
        "prompts": os.path.join(workdir, "prompts.json"),
        "workdir": workdir,
        "result": result,
        "batch_size": a.batch_size,
        "group_size": a.group_size,
        "max_new_tokens": a.max_new_tokens,
        "steps": a.steps,
        "lr": a.lr,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "CUDA_VISIBLE_DEVICES": "",
        "WANDB_DISABLED": "true",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run([a.trl_python, "-c", TRL_SCRIPT, json.dumps(cfg)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    out = json.load(open(result))
    steps, gens = out["step_s"][1:], out["generate_score_s"][1:]
    return {
        "step_s": statistics.median(steps),
        "phases_s": {
            "generate+reward+logprob": statistics.median(gens),
            "train": statistics.median(s - g for s, g in zip(steps, gens)),
        },
    }


def setup_trl(venv: str) -> None:
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = os.path.join(venv, "bin", "pip")
    # The CPU build first, so that trl's torch requirement is already satisfied.
    subprocess.run([pip, "install", "torch==2.13.0"], check=True)
    subprocess.run([pip, "install", "trl"], check=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup-trl", action="store_true", help="create the TRL venv and exit")
    p.add_argument("--venv", default=DEFAULT_VENV)
    p.add_argument("--trl-python", default="", help="python of a venv with trl (default: <venv>/bin/python)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is dropped)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--skip-compiled", action="store_true")
    p.add_argument("--out", default="")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    if a.setup_trl:
        setup_trl(a.venv)
        return
    a.trl_python = a.trl_python or os.path.join(a.venv, "bin", "python")
    if not os.path.exists(a.trl_python):
        raise SystemExit(f"no TRL venv at {a.venv}: run with --setup-trl first (or pass --trl-python)")
    trl_version = subprocess.run(
        [a.trl_python, "-c", "import trl, transformers; print(trl.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.split()
    env = environment()  # the code the runs import (main may move while they run)
    workdir = tempfile.mkdtemp(prefix="bench_rl_step_")
    model, jsonl = make_assets(workdir, n_prompts=a.batch_size * a.steps + 1, seed=0)
    runs: dict[str, list[dict]] = {"titanrl": [], "titanrl_compiled": [], "trl": []}
    for rep in range(a.repeats):
        runs["titanrl"].append(run_titanrl(a, model, jsonl, workdir, compiled=False))
        if not a.skip_compiled:
            runs["titanrl_compiled"].append(run_titanrl(a, model, jsonl, workdir, compiled=True))
        runs["trl"].append(run_trl(a, model, workdir))
        print(
            f"repeat {rep + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]['step_s']:.3f} s" for k, v in runs.items() if v),
            flush=True,
        )
    summary = {
        k: {
            "median_step_s": statistics.median(r["step_s"] for r in v),
            "median_phases_s": {ph: statistics.median(r["phases_s"][ph] for r in v) for ph in v[0]["phases_s"]},
        }
        for k, v in runs.items()
        if v
    }
    ratios = {
        f"trl_over_{k}": summary["trl"]["median_step_s"] / summary[k]["median_step_s"] for k in summary if k != "trl"
    }
    report = {
        "benchmark": "GRPO step time, titanrl vs TRL GRPOTrainer (CPU)",
        "trl": trl_version[0] if trl_version else "?",
        "transformers (trl venv)": trl_version[1] if len(trl_version) > 1 else "?",
        "config": {
            "threads": a.threads,
            "prompts_per_step": a.batch_size,
            "group_size": a.group_size,
            "max_new_tokens": a.max_new_tokens,
            "steps_per_run": a.steps,
            "repeats": a.repeats,
            "model": "Qwen3-shaped, 4 layers, dim 256, vocab 64, random weights",
        },
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    if a.out:
        write_json(a.out, report, env=env)


if __name__ == "__main__":
    main()

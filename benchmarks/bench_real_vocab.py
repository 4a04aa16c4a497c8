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
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.bench_rl_step import DEFAULT_VENV, setup_trl
from benchmarks.harness import REPO_ROOT, environment, write_json

VOCAB_SIZE = 151936
QWEN_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# Qwen2's pre-tokenizer split (digits one by one), then byte-level.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's ChatML template without the tools branch: a default system prompt when none is given.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Tina", "Randy", "Jasmine"]
ITEMS = ["clips", "apples", "cupcakes", "pencils", "stickers", "marbles", "books", "cookies"]
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

TRL_SCRIPT = r'''
import json, re, sys, time
import torch
import transformers, trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
rows = json.load(open(cfg["prompts"]))
dataset = Dataset.from_list(rows)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

def extract(text):
    """The line after the last '####', else the last number (the gsm8k verifier's order)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].replace(",", "").strip()
    numbers = NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else ""

def same_number(a, b):
    try:
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    except ValueError:
        return False

def reward(completions, answer, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if same_number(extract(t), a) else 0.0 for t, a in zip(texts, answer)]

def rss_gb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 2**20

class Timer(TrainerCallback):
    def __init__(self):
        self.steps, self.rss, self.start = [], [], None
    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.steps.append(time.perf_counter() - self.start)
        self.rss.append(rss_gb())

n_completions = cfg["batch_size"] * cfg["group_size"]
args = GRPOConfig(
    output_dir=cfg["workdir"] + "/trl_out", per_device_train_batch_size=n_completions,
    gradient_accumulation_steps=1, num_generations=cfg["group_size"],
    max_completion_length=cfg["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0, learning_rate=cfg["lr"],
    beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", max_steps=cfg["steps"],
    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
    shuffle_dataset=False, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    adam_beta1=0.9, adam_beta2=cfg["beta2"], adam_epsilon=1e-8, optim="adamw_torch_fused",
    gradient_checkpointing=cfg["activation_checkpointing"], dataloader_num_workers=0, disable_tqdm=True,
    model_init_kwargs={"dtype": "float32"},
)
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=reward, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
rss_after_init = rss_gb()
times = {"generate_score_s": [], "generate_s": [], "forward_s": []}
lengths = {"response_len": [], "prompt_len": []}

def timed(name, fn, on_out=None):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        times[name].append(time.perf_counter() - t0)
        if on_out is not None:
            on_out(out)
        return out
    return wrapper

def record_lengths(out):
    lengths["response_len"].append(out["completion_mask"].sum(1).float().mean().item())
    lengths["prompt_len"].append(out["prompt_mask"].sum(1).float().mean().item())

trainer._generate_and_score_completions = timed("generate_score_s", trainer._generate_and_score_completions,
                                                record_lengths)
trainer._generate = timed("generate_s", trainer._generate)
trainer.compute_loss = timed("forward_s", trainer.compute_loss)
timer = Timer()
trainer.add_callback(timer)
trainer.train()
text = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=False, add_generation_prompt=True)
first_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
n_params = sum(p.numel() for p in trainer.model.parameters())
json.dump({"step_s": timer.steps, "rss_gb": timer.rss, "rss_after_init_gb": rss_after_init, **times, **lengths,
           "first_prompt_ids": first_ids, "threads": torch.get_num_threads(), "params": n_params,
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__}}, open(cfg["result"], "w"))
'''


# ---- assets: problems, tokenizer, checkpoint ----


def make_problems(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` GSM8K-like word problems (question, numeric answer), from a few templates."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(2, 60) * 2, rng.randint(2, 12), rng.randint(2, 15)
        kind = rng.randrange(4)
        if kind == 0:
            q = (
                f"{name} sold {item} to {a} of her friends in April, and then she sold half as many {item} in "
                f"May. How many {item} did {name} sell altogether in April and May?"
            )
            ans = a + a // 2
        elif kind == 1:
            q = (
                f"{name} has {a} {item}. She buys {b} more boxes with {c} {item} in each box. How many {item} "
                f"does {name} have now?"
            )
            ans = a + b * c
        elif kind == 2:
            q = (
                f"A store sells {item} for ${c} each. {name} buys {b} {item} and pays with a $200 bill. How much "
                f"change does {name} get back?"
            )
            ans = 200 - b * c
        else:
            q = (
                f"{name} reads {b} pages a day for {c} days, then {a} pages a day for the next {b} days. How many "
                f"pages did {name} read in total?"
            )
            ans = b * c + a * b
        problems.append((f"{q} {INSTRUCTION}", str(ans)))
    return problems


def train_bpe(corpus: list[str], vocab_size: int):
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on `corpus` (special tokens kept whole)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_tokenizer(folder: str, corpus: list[str], bpe_vocab: int) -> None:
    """tokenizer.json in Qwen2.5's id layout, padded to VOCAB_SIZE ids, and tokenizer_config.json
    with the ChatML template (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    spec = json.loads(train_bpe(corpus, bpe_vocab).to_str())
    vocab = spec["model"]["vocab"]
    for token in QWEN_SPECIAL:
        del vocab[token]
    vocab = {t: i for i, t in enumerate(sorted(vocab, key=vocab.get))}  # BPE tokens at 0..n-1
    used = set(vocab.values()) | set(QWEN_SPECIAL.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(VOCAB_SIZE) if i not in used})
    vocab.update(QWEN_SPECIAL)
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in QWEN_SPECIAL.items()
    ]
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "chat_template": CHATML,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def model_args(n_layers: int):
    """Qwen2.5-0.5B's shape (the `qwen2.5-0.5b` flavor) with `n_layers` layers."""
    from titanrl.models.flavors import get_model_args

    args = get_model_args("qwen2.5-0.5b")
    args.n_layers = n_layers
    return args


def write_checkpoint(folder: str, n_layers: int, seed: int) -> int:
    """A random-weight HF checkpoint exported by titanrl, with Qwen2.5's special ids in config.json
    and generation_config.json; returns the parameter count."""
    import torch

    from titanrl.models.hf import export_hf
    from titanrl.models.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(model_args(n_layers))
    model.init_weights()
    export_hf(model, folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}, f)
    return sum(p.numel() for p in model.parameters())


def write_prompts(workdir: str, problems: list[tuple[str, str]]) -> tuple[str, str]:
    """(titanrl's JSONL of text prompts, TRL's JSON of one-user-message conversations)."""
    jsonl, trl_json = os.path.join(workdir, "prompts.jsonl"), os.path.join(workdir, "prompts.json")
    with open(jsonl, "w") as f:
        for q, a in problems:
            f.write(json.dumps({"prompt": q, "answer": a}) + "\n")
    with open(trl_json, "w") as f:
        json.dump([{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in problems], f)
    return jsonl, trl_json


def titanrl_prompt_ids(folder: str, problems: list[tuple[str, str]]) -> list[list[int]]:
    """The prompts as titanrl's trainer encodes them (ChatML, generation prompt)."""
    from titanrl.data.encode import PromptEncoder
    from titanrl.models.chat_template import ChatTemplate
    from titanrl.models.tokenizer import HFTokenizer

    encode = PromptEncoder(HFTokenizer(folder), ChatTemplate.from_folder(folder))
    return [encode(q) for q, _ in problems]


# ---- measuring a process ----


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _descendants(pid: int) -> list[int]:
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parent_of.items() if pp in frontier]
        found += children
        frontier = children
    return found


class RssSampler(threading.Thread):
    """Samples the RSS of a process and of its whole tree every `interval_s` until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_main_kib = self.peak_tree_kib = self.peak_other_kib = 0
        self.max_processes = 1
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            main = _rss_kib(self.pid)
            others = [_rss_kib(p) for p in _descendants(self.pid)]
            self.peak_main_kib = max(self.peak_main_kib, main)
            self.peak_tree_kib = max(self.peak_tree_kib, main + sum(others))
            self.peak_other_kib = max([self.peak_other_kib, *others])
            self.max_processes = max(self.max_processes, 1 + len(others))
            self.stopped.wait(self.interval_s)


def run_measured(cmd: list[str], env: dict, log_path: str) -> dict:
    """Run `cmd` to completion; its max RSS (os.wait4) and sampled RSS peaks, in GiB."""
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        sampler = RssSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stopped.set()
        sampler.join()
    if proc.returncode:
        with open(log_path) as f:
            raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}), log {log_path}:\n{f.read()[-3000:]}")
    return {
        "max_rss_gb": usage.ru_maxrss / 2**20,
        "sampled_peak_rss_gb": sampler.peak_main_kib / 2**20,
        "sampled_peak_tree_rss_gb": sampler.peak_tree_kib / 2**20,
        "sampled_peak_child_rss_gb": sampler.peak_other_kib / 2**20,
        "processes": sampler.max_processes,
        "wall_s": time.perf_counter() - began,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }


# ---- the two sides ----


def run_titanrl(a, model: str, jsonl: str, workdir: str, tag: str) -> dict:
    dump = tempfile.mkdtemp(prefix=f"titanrl_{tag}_", dir=workdir)
    max_prompt = 160
    num_blocks = 2 * a.batch_size * a.group_size * math.ceil((max_prompt + a.max_new_tokens) / 16)
    model_opts = (
        [f"--model.flavor={a.flavor}", f"--model.tokenizer={model}", "--model.hf_checkpoint="]
        if a.flavor
        else [f"--model.hf_checkpoint={model}", f"--model.tokenizer={model}"]
    )
    cmd = [
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


def run_trl(a, model: str, trl_json: str, workdir: str) -> dict:
    result = os.path.join(workdir, f"trl_{time.monotonic_ns()}.json")
    cfg = {
        "model": model,
        "prompts": trl_json,
        "workdir": workdir,
        "result": result,
        "batch_size": a.batch_size,
        "group_size": a.group_size,
        "max_new_tokens": a.max_new_tokens,
        "steps": a.steps,
        "lr": a.lr,
        "beta2": a.beta2,
        "activation_checkpointing": a.activation_checkpointing,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "CUDA_VISIBLE_DEVICES": "",
        "WANDB_DISABLED": "true",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("PYTHONPATH", None)
    mem = run_measured([a.trl_python, "-c", TRL_SCRIPT, json.dumps(cfg)], env, result + ".log")
    out = json.load(open(result))
    steps, gen_score = out["step_s"][1:], out["generate_score_s"][1:]
    gen, fwd = out["generate_s"][1:], out["forward_s"][1:]
    return {
        "step_s": statistics.median(steps),
        "phases_s": {
            "generate": statistics.median(gen),
            "reward+scoring": statistics.median(s - g for s, g in zip(gen_score, gen)),
            "forward": statistics.median(fwd),
            "backward+optimizer": statistics.median(s - gs - f for s, gs, f in zip(steps, gen_score, fwd)),
        },
        "rss_at_step_end_gb": out["rss_gb"],
        "rss_after_init_gb": out["rss_after_init_gb"],
        "response_len": statistics.mean(out["response_len"]),
        "prompt_len": statistics.mean(out["prompt_len"]),
        "first_prompt_ids": out["first_prompt_ids"],
        "threads": out["threads"],
        "params": out["params"],
        "versions": out["versions"],
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
    optimizer = {
        "name": "AdamW, fused (titanrl's recipe; TRL's default adamw_torch_fused)",
        "lr": a.lr,
        "betas": [0.9, a.beta2],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "lr_schedule": "constant",
    }
    config = {
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

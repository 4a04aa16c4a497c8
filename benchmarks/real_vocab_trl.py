"""The TRL side of bench_real_vocab.py: GRPOTrainer in TRL's own virtual environment, on the same
model folder, prompts, sampling and optimizer settings as titanrl's run, timed per phase by a
callback; its peak memory measured as titanrl's (`run_measured`)."""

import json
import os
import statistics
import time

from benchmarks.harness import run_measured

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

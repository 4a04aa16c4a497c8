"""A mixture-of-experts model against a dense one of equal active parameters, on one device.

    python -m benchmarks.bench_moe --out benchmarks/bench_moe.json

`debug-moe` (Qwen3-MoE shape: 8 experts of width 384, top-2, 3 of 4 layers MoE) and `debug`
(Qwen3, the same attention and width 768 feed-forwards) each activate the same parameters per
token (3.22M: two experts of width 384 = one MLP of width 768); the MoE model holds 8.5M in all.
Random weights, float32, the same prompts and tokens for both:

- `generate`: the paged generator (titanrl.generator, the trainer's model code; the MoE model
  records its routes for replay as the RL loop does), greedy, EOS off, `--gen-batch` prompts of
  `--prompt-len` tokens, `--new-tokens` each: tokens/s of the whole call and of decode alone
  ((time of N tokens - time of 1) as in `harness.decode_seconds`).
- `train`: one step on the same [batch, seq] tokens: forward, cross-entropy (+ 0.001 x the
  load-balancing loss for the MoE model, as the MoE recipe), backward, AdamW step.

Timed calls of the two models alternate (`timeit_each`); medians of `--repeat` calls after one
warm-up (`seconds` keeps every call; the ratios `*_of_fastest_calls` compare the minima, the
calls a shared machine disturbed least). `peak_memory`: each (model, phase) runs once more in a
fresh process that samples its resident set every millisecond: the peak, and that less the RSS
before the phase (Python + torch): CPU allocations have no allocator counter as CUDA's
`max_memory_allocated`. Ratios are MoE / dense.
"""

import argparse
import json
import resource
import subprocess
import sys
import threading
import time

import torch

from benchmarks.harness import REPO_ROOT, decode_seconds, timeit_each, write_json
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

MODELS = {"dense": "debug", "moe": "debug-moe"}
AUX_LOSS_COEFF = 0.001
DOC_TABLES = [
    ("Parameters (total, active per token)", ["params"], None),
    ("Median tokens/s", ["tokens_per_s"], None),
    ("Peak memory (MiB)", ["peak_memory"], None),
    ("MoE over dense", ["ratios"], None),
]


def active_params(model: Transformer) -> int:
    """Parameters one token uses: all, less the experts its router does not pick."""
    total = sum(p.numel() for p in model.parameters())
    for moe in model.moe_layers():
        per_expert = sum(w[0].numel() for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
        total -= (moe.experts.w1.shape[0] - model.args.moe_top_k) * per_expert
    return total


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def make_generator(args: TransformerModelArgs, a: argparse.Namespace) -> Generator:
    block = 16
    config = GeneratorConfig(
        block_size=block,
        num_blocks=a.gen_batch * ((a.prompt_len + a.new_tokens) // block + 2),
        max_num_seqs=a.gen_batch,
        max_num_batched_tokens=max(4096, a.gen_batch * a.prompt_len),
        enable_prefix_caching=False,
    )
    return Generator(args, config, torch.device("cpu"), dtype=torch.float32)  # random weights, no EOS


def generate_fn(gen: Generator, prompts: list[list[int]]):
    def run(n: int) -> None:
        gen.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))

    return run


def train_fn(model: Transformer, tokens_BT: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    moe = bool(model.moe_layers())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens_BT[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens_BT[:, 1:].flatten())
        if moe:
            loss = loss + AUX_LOSS_COEFF * model.moe_aux_loss()
        loss.backward()
        opt.step()

    return step


def inputs(a: argparse.Namespace, vocab: int) -> tuple[list[list[int]], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (a.gen_batch, a.prompt_len), generator=g).tolist()
    return prompts, torch.randint(3, vocab, (a.train_batch, a.train_seq + 1), generator=g)


def measure_speed(a: argparse.Namespace) -> dict:
    """Generate and train tokens/s of both models, their calls interleaved."""
    args = {k: get_model_args(f) for k, f in MODELS.items()}
    prompts, tokens = inputs(a, args["dense"].vocab_size)
    gens = {k: make_generator(v, a) for k, v in args.items()}
    runs = {k: generate_fn(g, prompts) for k, g in gens.items()}
    gen_t = timeit_each({k: (lambda r=r: r(a.new_tokens)) for k, r in runs.items()}, repeat=a.repeat)
    decode = {k: sorted(decode_seconds(r, a.new_tokens) for _ in range(a.repeat)) for k, r in runs.items()}
    for g in gens.values():
        g.sleep()
    models = {k: build(v) for k, v in args.items()}
    train_t = timeit_each({k: train_fn(m, tokens) for k, m in models.items()}, repeat=a.repeat)
    n_gen, n_dec = a.gen_batch * a.new_tokens, a.gen_batch * (a.new_tokens - 1)
    n_train = a.train_batch * a.train_seq
    out = {
        "params": {
            k: {"total": sum(p.numel() for p in m.parameters()), "active": active_params(m)} for k, m in models.items()
        },
        "tokens_per_s": {
            k: {
                "generate": n_gen / gen_t[k].median,
                "decode": n_dec / decode[k][len(decode[k]) // 2],
                "train": n_train / train_t[k].median,
            }
            for k in MODELS
        },
        "seconds": {k: {"generate": gen_t[k], "train": train_t[k]} for k in MODELS},
    }
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def memory_worker(kind: str, phase: str, a: argparse.Namespace) -> dict:
    """Peak resident memory of one (model, phase) in this fresh process, sampled every
    millisecond (ru_maxrss would report the imports' own peak), and that less the RSS before it."""
    base, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    args = get_model_args(MODELS[kind])
    prompts, tokens = inputs(a, args.vocab_size)
    if phase == "generate":
        generate_fn(make_generator(args, a), prompts)(a.new_tokens)
    else:
        step = train_fn(build(args), tokens)
        step()
        step()  # the optimizer's state exists from the first step on
    done.set()
    sampler.join()
    return {"peak_rss_mib": peak[0], "over_imports_mib": peak[0] - base}


def measure_memory(a: argparse.Namespace) -> dict:
    shape = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("gen_batch", "prompt_len", "new_tokens")]
    shape += [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("train_batch", "train_seq")]
    out: dict = {}
    for kind in MODELS:
        for phase in ("generate", "train"):
            cmd = [sys.executable, "-m", "benchmarks.bench_moe", "--memory-worker", f"{kind}:{phase}", *shape]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
            out.setdefault(kind, {})[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def ratios(speed: dict, memory: dict) -> dict:
    tps = speed["tokens_per_s"]
    out = {f"{p}_tokens_per_s": tps["moe"][p] / tps["dense"][p] for p in ("generate", "decode", "train")}
    for p in ("generate", "train"):  # fastest calls: the least disturbed by a busy machine
        best = {k: speed["seconds"][k][p].min for k in MODELS}
        out[f"{p}_tokens_per_s_of_fastest_calls"] = best["dense"] / best["moe"]
    for phase in ("generate", "train"):
        m = {k: memory[k][phase]["over_imports_mib"] for k in MODELS}
        out[f"{phase}_peak_memory_over_imports"] = m["moe"] / m["dense"] if m["dense"] > 0 else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/bench_moe.json")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generate call (GRPO: 8 prompts x 8)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--train-seq", type=int, default=64)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.memory_worker:
        print(json.dumps(memory_worker(*a.memory_worker.split(":"), a)))
        return
    config = {k: getattr(a, k) for k in ("gen_batch", "prompt_len", "new_tokens", "train_batch", "train_seq")}
    speed = measure_speed(a)
    memory = measure_memory(a)
    results = {
        "benchmark": "MoE (debug-moe, 8 experts top-2) vs dense (debug) of equal active parameters",
        "config": {**config, "repeat": a.repeat, "dtype": "float32", "threads": torch.get_num_threads()},
        **speed,
        "peak_memory": memory,
        "ratios": ratios(speed, memory),
    }
    write_json(a.out, results, device="cpu")
    print(json.dumps({"tokens_per_s": speed["tokens_per_s"], "ratios": results["ratios"]}, indent=2))


if __name__ == "__main__":
    main()

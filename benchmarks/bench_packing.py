"""Sequence packing vs padded micro-batches: the RL train phase on a long-tailed length workload.

    python -m benchmarks.bench_packing --out benchmarks/bench_packing.json

Workload (as in reasoning RL): prompts of 16-48 tokens; responses lognormal (median 24 tokens,
sigma 0.8) truncated at the length cap, plus ~8% of them at the cap exactly (rollouts that
ran out of budget). Both sides train the same model on the same rollouts with the same GRPO
token-mean loss over the same micro-batch token budget (training.micro_batch_tokens):
"padded" is the recipe's plan without packing (rows sorted by length, cut at about equal
padded tokens: `data.batch.micro_batch_plan`), "packed" is `data.packing.packed_micro_batches`
(first-fit decreasing into rows of the batch width, document-causal SDPA mask on CPU). Train
phase = forward + backward of the policy loss over every micro-batch (what `RLRecipe.update_policy`
times, less the optimizer step, which is the same for both); the logprob phase (a no-grad
forward of the whole batch, the reference / old logprobs) is timed too. Reps alternate padded /
packed; the first of each is a warm-up; medians are reported. A second, low-waste workload
(lengths within +-10%) shows what packing costs when there is little padding to remove
(the reason for training.packing = "auto"'s threshold).
"""

import argparse
import os
import random
import statistics
import time

import torch

from benchmarks.harness import REPO_ROOT, write_json
from benchmarks.shapes import D512X8
from titanrl.algorithms import LossInputs, get_algorithm
from titanrl.config import load_config
from titanrl.data.batch import build_sequence_batch, micro_batch_plan, num_micro_batches, trim_padding
from titanrl.data.batch_forward import forward_logprobs
from titanrl.data.packing import layout_of, packed_micro_batches
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
# Train / logprob phases: wall and process CPU seconds together, so timed here, not by the harness.
DOC_TABLES = [
    (
        "Padded vs packed: micro-batches, token slots, median seconds and speed-ups",
        ["results"],
        [
            "rows",
            "micro_batches.*",
            "token_slots.*",
            "median_s.wall.*",
            "speedup_packed_over_padded.*",
            "max_abs_loss_diff",
        ],
    ),
]


def long_tailed_lengths(rng: random.Random, n: int, cap: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        prompt = rng.randint(16, 48)
        resp = cap if rng.random() < 0.08 else min(cap, max(1, round(rng.lognormvariate(0.0, 0.8) * 24)))
        out.append((prompt, resp))
    return out


def narrow_lengths(rng: random.Random, n: int, cap: int) -> list[tuple[int, int]]:
    return [(32, rng.randint(int(cap * 0.8), cap)) for _ in range(n)]


def rollouts(shape: list[tuple[int, int]], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(p)] for p, _ in shape]
    comps = [[rng.randrange(1, vocab) for _ in range(r)] for _, r in shape]
    batch = build_sequence_batch(prompts, comps, 0, [[-1.0] * r for _, r in shape])
    batch["advantages"] = torch.randn(len(shape), generator=torch.Generator().manual_seed(seed))
    return batch


def padded_micro_batches(batch, budget: int):
    lengths = batch["length"].tolist()
    plan = micro_batch_plan(torch.tensor(lengths), min(num_micro_batches(lengths, budget), len(lengths)))
    return [trim_padding(batch[rows]) for rows in plan]


def train_phase(model, algo, batch, mbs, chunk: int) -> tuple[tuple[float, float], float]:
    """((wall seconds, process CPU seconds), loss) of forward + backward over the micro-batches."""
    model.zero_grad(set_to_none=True)
    num_tokens, num_seqs, total = batch["loss_mask"].sum().item(), float(batch.batch_size[0]), 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for mb in mbs:
        logprobs, _ = forward_logprobs(model, mb, False, chunk, with_entropy=True)
        out = algo.loss(
            LossInputs(
                logprobs,
                logprobs.detach(),
                mb["advantages"],
                mb["loss_mask"],
                num_global_tokens=num_tokens,
                num_global_seqs=num_seqs,
            )
        )
        out.loss.backward()
        total += out.loss.item()
    return (time.perf_counter() - start, time.process_time() - cpu), total


def logprob_phase(model, batch, packing: str, chunk: int) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        forward_logprobs(model, batch, False, chunk, packing=packing)
    return time.perf_counter() - start, time.process_time() - cpu


def measure(args: TransformerModelArgs, shape, budget: int, reps: int, chunk: int = 256) -> dict:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    algo = get_algorithm("grpo")(load_config([f"--job.config_file={CONFIG}"]).algorithm)
    batch = rollouts(shape, args.vocab_size, 0)
    lengths = batch["length"].tolist()
    padded_mbs, packed_mbs = padded_micro_batches(batch, budget), packed_micro_batches(batch, budget, None)
    times = {k: {"padded": [], "packed": []} for k in ("wall", "cpu", "lp_wall", "lp_cpu")}
    losses, grads = {}, {}
    for rep in range(reps + 1):
        for name, mbs in (
            (("padded", padded_mbs), ("packed", packed_mbs))
            if rep % 2 == 0
            else (("packed", packed_mbs), ("padded", padded_mbs))
        ):
            seconds, loss = train_phase(model, algo, batch, mbs, chunk)
            lp_seconds = logprob_phase(model, batch, "on" if name == "packed" else "off", chunk)
            if rep:  # rep 0 is the warm-up
                for key, value in zip(("wall", "cpu", "lp_wall", "lp_cpu"), (*seconds, *lp_seconds)):
                    times[key][name].append(round(value, 4))
            losses[name] = loss
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    padded_slots = sum(mb["tokens"].shape[0] * (mb["tokens"].shape[1] - 1) for mb in padded_mbs)
    packed_slots = sum(layout_of(mb, "off").R * layout_of(mb, "off").S for mb in packed_mbs)
    med = {key: {k: statistics.median(v) for k, v in d.items()} for key, d in times.items()}
    speedup = {key: m["padded"] / m["packed"] for key, m in med.items()}
    return {
        "rows": len(lengths),
        "real_input_tokens": sum(n - 1 for n in lengths),
        "batch_width": max(lengths),
        "micro_batch_tokens": budget,
        "micro_batches": {"padded": len(padded_mbs), "packed": len(packed_mbs)},
        "token_slots": {"padded": padded_slots, "packed": packed_slots},
        "median_s": med,
        "speedup_packed_over_padded": speedup,
        "all_s": times,
        "loss": losses,
        "max_abs_loss_diff": abs(losses["padded"] - losses["packed"]),
        "max_abs_grad_diff": (grads["padded"] - grads["packed"]).abs().max().item(),
        "grad_scale": grads["padded"].abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "bench_packing.json"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    parser.add_argument("--larger", action="store_true", help="also a 8-layer dim-512 model (slower)")
    parser.add_argument("--larger-rows", type=int, default=32)
    parser.add_argument("--larger-reps", type=int, default=3)
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    cap = 192
    rng = random.Random(0)
    debug = get_model_args("debug")
    report = {
        "what": "RL train phase (GRPO token-mean loss forward+backward over micro-batches), padded vs packed",
        "workload": {
            "long_tailed": f"{cli.rows} rollouts; prompt ~ U[16, 48] tokens; response = {cap} (the cap) with "
            "p=0.08, else min(cap, round(24 * lognormal(0, 0.8)))",
            "narrow": f"{cli.rows} rollouts; prompt 32 tokens; response ~ U[{int(cap * 0.8)}, {cap}]",
        },
        "tolerance": {"max_abs_loss_diff": 1e-5, "note": "float32; packed and padded differ in BLAS blocking only"},
        "timing": "medians of alternating reps, wall clock and this process's CPU time",
        "loadavg_1min_before": os.getloadavg()[0],
        "reps": {"debug": cli.reps, "larger": cli.larger_reps if cli.larger else None},
        "results": {},
    }
    tail = long_tailed_lengths(rng, cli.rows, cap)
    # micro_batch_tokens = 0 (the default: one micro-batch per mini-batch) and a budget.
    report["results"]["debug/long_tailed/micro_batch_tokens=0"] = measure(debug, tail, 0, cli.reps)
    report["results"][f"debug/long_tailed/micro_batch_tokens={cli.budget}"] = measure(debug, tail, cli.budget, cli.reps)
    report["results"][f"debug/narrow/micro_batch_tokens={cli.budget}"] = measure(
        debug, narrow_lengths(rng, cli.rows, cap), cli.budget, cli.reps
    )
    if cli.larger:
        larger = D512X8
        report["results"][f"d512x8/long_tailed/micro_batch_tokens={cli.budget}"] = measure(
            larger, long_tailed_lengths(random.Random(1), cli.larger_rows, cap), cli.budget, cli.larger_reps
        )
    report["acceptance"] = {
        "target": "packed >= 1.5x faster (train phase, wall median) on the long-tailed workload "
        "with |loss diff| <= 1e-5"
    }
    for name, r in report["results"].items():
        ok = r["max_abs_loss_diff"] <= report["tolerance"]["max_abs_loss_diff"]
        m, x = r["median_s"], r["speedup_packed_over_padded"]
        print(
            f"{name}: train wall padded {m['wall']['padded']:.3f}s packed {m['wall']['packed']:.3f}s -> "
            f"{x['wall']:.2f}x (cpu {x['cpu']:.2f}x; slots {r['token_slots']['padded']} vs "
            f"{r['token_slots']['packed']}), logprob {x['lp_wall']:.2f}x (cpu {x['lp_cpu']:.2f}x), "
            f"|dloss| {r['max_abs_loss_diff']:.2e} {'ok' if ok else 'OVER TOLERANCE'}"
        )
    report["loadavg_1min_after"] = os.getloadavg()[0]
    write_json(cli.out, report)


if __name__ == "__main__":
    main()

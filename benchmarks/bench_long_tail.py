"""Long-tail rollouts: synchronous steps vs partial rollouts, one-step and async, side by side on one workload.

    python -m benchmarks.bench_long_tail --out benchmarks/bench_long_tail.json

Workload (written here as a JSONL data set): most prompts ask for a short answer (a number), a
few (`--long_frac`) for a long one (the number, then a tail of digits past max_new_tokens); a
short SFT warm-up teaches the debug model both, then GRPO samples at temperature 1, so most
responses are a few tokens and about `--long_frac` of the groups run to the length cap, as in
reasoning RL. The JSON records the response-length percentiles measured in each run.

The warm-up runs once (the RL job with `--training.steps=0`, exported as a Hugging Face folder);
every mode then starts from that folder, so all of them begin from the same policy. The modes
(synchronous, partial rollouts, one-step, synchronous with `--training.balance_tokens=false`:
each rank trains the groups it generated, and `async_kN`: rollout.mode = 'async' with
max_staleness N; `--modes` picks them) run the same job (same seed, `--steps` RL steps) under
torchrun with `--nproc` gloo ranks (one-step and async: half of them generate, half train),
`--repeats` times each, alternating modes so that a slow spell of the machine hits all of them;
rates are the median over repeats. `wall_samples_per_s` is the wall clock's (end of step 1 to
the end of the last step, evaluations included), the fair one across modes whose phases overlap;
async runs also report each side's idle fraction, and every run its held-out accuracy curve
against wall time (`eval_curve`: seconds, step, accuracy; `--eval_freq`), plotted by
`python -m benchmarks.bench_long_tail --plot JSON PNG`.
samples/s = samples trained over the RL steps / their wall time (the sum of the phase timers,
first step excluded: it carries one-time costs); `steady_*` counts only the second half of the
steps (partial rollouts start by training the short groups while the long ones are in flight,
so their first steps are faster than their steady state). Partial rollouts train whichever
groups complete (at least the batch), so the modes are compared per trained sample and per
trained response token. Also reported: decode steps per trained sample (the busiest rank's),
the cost of generation where a decode step costs about the same at any batch size (an
accelerator at these sizes); on this CPU a step's cost grows with its batch, so samples/s
understates what the tail costs there.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness import REPO_ROOT, environment, write_json

# The trainer ranks' phases (one-step: generation and rewards run on the rollout ranks, and the
# trainer's wait for them is time_wait_rollouts).
PHASES = (
    "time_sync",
    "time_generate",
    "time_reward",
    "time_balance",
    "time_logprob",
    "time_train",
    "time_wait_rollouts",
)


def write_workload(path: str, rows: int, long_frac: float, long_chars: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            n = rng.randrange(100, 1000)
            long = rng.random() < long_frac
            tail = "".join(rng.choice("0123456789") for _ in range(long_chars)) if long else ""
            prompt = f"{'long' if long else 'short'} {n}"
            f.write(
                json.dumps({"prompt": prompt, "answer": str(n), "solution": f"{n}{' ' + tail if tail else ''}"}) + "\n"
            )


def job(data: str, folder: str, args, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "titanrl.train",
        f"--job.config_file={os.path.join(REPO_ROOT, 'train_configs', 'grpo_reverse_debug.toml')}",
        *([f"--data.path={data}"] if args.workload == "long_tail" else []),
        f"--data.num_eval_samples={args.eval_samples}",
        f"--metrics.eval_freq={args.eval_freq}",
        f"--parallelism.dp_shard={args.nproc}",
        f"--training.steps={steps}",
        f"--training.batch_size={args.batch_size}",
        f"--algorithm.group_size={args.group_size}",
        f"--generator.max_new_tokens={args.max_new_tokens}",
        "--algorithm.off_policy_correction=tis",
        f"--job.dump_folder={folder}",
        "--reward.num_workers=1",
    ]


def launch(cmd: list[str], what: str, nproc: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def warm_up(data: str, folder: str, args) -> str:
    """The SFT warm-up once, exported as a Hugging Face folder every mode starts from."""
    launch(
        job(data, folder, args, steps=0) + [f"--sft_warmup.steps={args.sft_steps}", "--checkpoint.export_hf=true"],
        "warm-up",
        args.nproc,
    )
    return os.path.join(folder, "hf")


def run(mode: str, data: str, hf: str, folder: str, args, seed: int = 0) -> list[dict]:
    cmd = job(data, folder, args, args.steps) + [
        f"--model.hf_checkpoint={hf}",
        "--sft_warmup.steps=0",
        "--checkpoint.enable=false",
        f"--job.seed={seed}",
    ]
    if mode == "sync_unbalanced":  # each rank trains the groups it generated (before training.balance_tokens)
        cmd += ["--training.balance_tokens=false"]
    if mode == "partial":
        cmd += ["--rollout.partial=true", f"--rollout.oversample={args.oversample}"]
    if mode == "one_step":  # the same ranks, split: half generate, half train
        cmd = [c for c in cmd if not c.startswith("--parallelism.dp_shard")]
        cmd += [
            "--rollout.mode=one_step",
            f"--rollout.rollout_ranks={args.nproc // 2}",
            f"--parallelism.dp_shard={args.nproc // 2}",
        ]
    if mode.startswith("async_k"):  # the same ranks, split: half decode a stream, half train
        cmd = [c for c in cmd if not c.startswith("--parallelism.dp_shard")]
        cmd += [
            "--rollout.mode=async",
            f"--rollout.rollout_ranks={args.nproc // 2}",
            f"--rollout.max_staleness={int(mode[len('async_k') :])}",
            f"--parallelism.dp_shard={args.nproc - args.nproc // 2}",
        ]
    launch(cmd, mode, args.nproc)
    steps = {}
    for line in open(os.path.join(folder, "metrics.jsonl")):
        r = json.loads(line)
        if r.get("phase") == "rl" and "reward_mean" in r:
            steps[r["step"]] = r
    return [steps[s] for s in sorted(steps)]


def rates(timed: list[dict], batch_size: int, group_size: int) -> dict:
    seconds = sum(sum(r.get(p, 0.0) for p in PHASES) for r in timed)
    per_step = [r.get("trained_groups", batch_size) * group_size for r in timed]
    samples = sum(per_step)
    tokens = sum(n * r["response_len"] for n, r in zip(per_step, timed))
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "response_tokens": tokens,
        "response_tokens_per_s": tokens / seconds,
        "response_len_trained_mean": tokens / samples,
        "step_s_mean": seconds / len(timed),
    }


def wall(steps: list[dict], batch_size: int, group_size: int) -> dict:
    """Wall time from the end of step 1 to the end of the last step (evaluations included: every
    mode runs the same ones), the samples trained meanwhile, and the held-out accuracy curve
    against wall time since the end of step 1."""
    t0 = steps[0]["time"]
    samples = sum(r.get("trained_groups", batch_size) * group_size for r in steps[1:])
    seconds = steps[-1]["time"] - t0
    return {
        "wall_s": seconds,
        "wall_samples_per_s": samples / seconds,
        "eval_curve": [(r["time"] - t0, r["step"], r["eval_accuracy"]) for r in steps if "eval_accuracy" in r],
    }


ASYNC_KEYS = ("trainer_idle_frac", "rollout_idle_frac", "version_lag_mean", "rollout_tokens_per_s")


def stream_metrics(timed: list[dict]) -> dict:
    """Async only: each side's idle fraction and the staleness, mean over steps."""
    if "trainer_idle_frac" not in timed[-1]:
        return {}
    out = {k: statistics.mean(r[k] for r in timed if k in r) for k in ASYNC_KEYS}
    out["swaps_mid_decode"] = timed[-1]["swaps_mid_decode"]
    out["groups_dropped"] = sum(r["groups_dropped"] for r in timed)
    return out


def summarise(steps: list[dict], batch_size: int, group_size: int) -> dict:
    timed = steps[1:]
    whole = rates(timed, batch_size, group_size)
    steady = rates(steps[len(steps) // 2 :], batch_size, group_size)
    return {
        **whole,
        **wall(steps, batch_size, group_size),
        **stream_metrics(timed),
        **{f"steady_{k}": v for k, v in steady.items()},
        "generate_s_mean": sum(r.get("time_generate", r.get("rollout_generate_s", 0.0)) for r in timed) / len(timed),
        "train_s_mean": sum(r["time_train"] for r in timed) / len(timed),
        # Decode steps (the busiest rank's) per trained sample: what a latency-bound accelerator pays.
        "decode_steps_per_sample": sum(r["decode_steps"] for r in timed) / whole["samples"],
        "response_len_p50": [r["response_len_p50"] for r in steps],
        "response_len_p90": [r["response_len_p90"] for r in steps],
        "response_len_max": [r["response_len_max"] for r in steps],
        "reward_mean": [r["reward_mean"] for r in steps],
        # Tokens of the most loaded trainer rank over the mean, as generated and as trained
        # (training.balance_tokens moves whole groups between ranks; absent on one trainer rank).
        **(
            {
                "rank_tokens_imbalance_before": statistics.mean(r["rank_tokens_imbalance_before"] for r in timed),
                "rank_tokens_imbalance": statistics.mean(r["rank_tokens_imbalance"] for r in timed),
            }
            if "rank_tokens_imbalance" in timed[0]
            else {}
        ),
        **(
            {
                "in_flight_groups_at_end": steps[-1]["in_flight_groups"],
                "stale_token_frac": [r["stale_token_frac"] for r in steps],
                "version_lag_max": [r["version_lag_max"] for r in steps],
            }
            if "stale_token_frac" in steps[0]
            else {}
        ),
    }


RATES = (
    "samples_per_s",
    "response_tokens_per_s",
    "steady_samples_per_s",
    "steady_response_tokens_per_s",
    "wall_samples_per_s",
)
MODES = ("sync", "partial", "one_step", "sync_unbalanced", "async_k1", "async_k2", "async_k4")
DOC_TABLES = [
    ("Rates, median over repeats", ["sync|partial|one_step|sync_unbalanced|async_k1|async_k2|async_k4"], None),
    ("Against synchronous steps", ["*_vs_sync_*"], None),
]


def plot_curves(json_path: str, out: str) -> None:
    """Held-out accuracy against wall time, every mode's repeats side by side (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("plotting needs matplotlib: pip install -e '.[plot]'") from e
    results = json.load(open(json_path))["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, mode in enumerate(m for m in MODES if m in results):
        for j, r in enumerate(results[mode]["repeats"]):
            seconds, _, accuracy = zip(*r["eval_curve"])
            ax.plot(seconds, accuracy, marker="o", color=f"C{i}", alpha=0.8, label=mode if j == 0 else None)
    ax.set_xlabel("wall seconds since the end of step 1")
    ax.set_ylabel("held-out accuracy")
    c = results["config"]
    seeds = "seeds 0-" + str(c["repeats"] - 1) if c.get("seed_per_repeat") else f"{c['repeats']} repeats"
    ax.set_title(f"{c.get('workload', 'long_tail')} workload, {c['nproc']} CPU ranks, {seeds}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_args() -> tuple[argparse.Namespace, tuple[str, ...]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_long_tail.json")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=224)
    parser.add_argument("--long_frac", type=float, default=0.06)
    parser.add_argument("--sft_steps", type=int, default=40)
    parser.add_argument("--oversample", type=float, default=2.0)
    parser.add_argument("--eval_freq", type=int, default=0, help="held-out evaluation every N steps (0: at the end)")
    parser.add_argument(
        "--workload",
        default="long_tail",
        choices=("long_tail", "reverse"),
        help="long_tail (written here) or the debug job's embedded reverse task, which learns within tens of steps",
    )
    parser.add_argument("--eval_samples", type=int, default=16, help="held-out prompts per evaluation")
    parser.add_argument("--seed_per_repeat", action="store_true", help="repeat i runs with job.seed = i")
    parser.add_argument("--modes", default="sync,partial,one_step,sync_unbalanced", help=f"of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    if not set(modes) <= set(MODES) or "sync" not in modes:
        parser.error(f"--modes: 'sync' and any of {', '.join(MODES)}")
    return args, modes


def main() -> None:
    if sys.argv[1:2] == ["--plot"]:  # --plot JSON PNG: the curves of a finished run
        return plot_curves(sys.argv[2], sys.argv[3])
    args, modes = parse_args()
    work = tempfile.mkdtemp(prefix="bench_long_tail_")
    data = os.path.join(work, "long_tail.jsonl")
    # Past the cap, within the debug model's 256-token context (SFT trains on prompt + solution).
    write_workload(data, 4000, args.long_frac, long_chars=min(args.max_new_tokens + 40, 240))
    env = environment()  # taken now: the runs import the code as it is at the start
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},  # defaults included
        "workload": "the debug job's reverse task (train_configs/grpo_reverse_debug.toml), "
        f"debug model after {args.sft_steps} SFT steps, temperature 1"
        if args.workload == "reverse"
        else f"{1 - args.long_frac:.0%} of prompts want a 3-digit answer, {args.long_frac:.0%} a long one "
        f"(past max_new_tokens={args.max_new_tokens}); debug model after {args.sft_steps} SFT steps "
        "(run once, every mode starts from it), temperature 1",
    }
    hf = warm_up(data, os.path.join(work, "warm_up"), args)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in modes:
            runs[mode].append(
                summarise(
                    run(mode, data, hf, os.path.join(work, f"{mode}_{i}"), args, i if args.seed_per_repeat else 0),
                    args.batch_size,
                    args.group_size,
                )
            )
            print(mode, i, json.dumps({k: runs[mode][-1][k] for k in RATES}), flush=True)
    for mode in modes:
        medians = {k: statistics.median(r[k] for r in runs[mode]) for k in (*RATES, *ASYNC_KEYS) if k in runs[mode][0]}
        final = [r["eval_curve"][-1][2] for r in runs[mode]]
        report[mode] = {**medians, "final_eval_accuracy": statistics.mean(final), "repeats": runs[mode]}
    for mode in modes[1:]:
        for k in RATES:
            report[f"{mode}_vs_sync_{k}"] = report[mode][k] / report["sync"][k]
    if "partial" in modes:
        report["partial_vs_sync_decode_steps_per_sample"] = statistics.median(
            s["decode_steps_per_sample"] / p["decode_steps_per_sample"] for s, p in zip(runs["sync"], runs["partial"])
        )
    print(json.dumps({k: v for k, v in report.items() if "_vs_" in k}, indent=1))
    write_json(args.out, report, env=env)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

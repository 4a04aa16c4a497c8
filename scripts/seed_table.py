"""Run a seeded job for several seeds and tabulate its held-out evaluations: mean and min-max.

One seeded run is one sample of a noisy RL curve, and its numbers hold on one kind of CPU only
(BLAS code paths differ across CPUs). This script runs the job once per seed, each in its own
dump folder (`<dump-root>/seed<N>`), `--parallel` at a time with the cores split between them,
then reads each run's metrics.jsonl and prints a markdown table: one row per evaluation step,
each held-out metric as the mean over seeds and its min-max, and the mean training reward of the
first and last 10 steps. The table, the per-seed values, the command, the commit, the CPU model
and the torch version go to a JSON file (`--out`).

    python scripts/seed_table.py                                   # the README's main job, seeds 0 1 2
    python scripts/seed_table.py --seeds 0 1 2 3 --parallel 2
    python scripts/seed_table.py --table-only                      # rebuild from the dump folders
    python scripts/seed_table.py --config train_configs/grpo_smollm2_short_answer.toml
    python scripts/seed_table.py -- --training.steps=4             # overrides after -- go to every run

Seeds change the model's initialisation, the prompts and the samples. On one machine a seed logs
the same numbers at the same threads per run. Another thread count changes float rounding: seed 0
of the main job at 1 and at 2 threads differed only in the generator-vs-trainer diagnostics
(`gen_logprob_diff`, `mismatch_kl`, 4th digit, 4 of 120 steps), but nothing promises more.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_metrics import load_rows  # noqa: E402  (a sibling script, not a package)

DEFAULT_CONFIG = "train_configs/grpo_reverse_debug.toml"
BEFORE_SFT = "eval_accuracy_before_sft"
# Evaluation keys that are counts or bookkeeping, not accuracies: never tabulated.
SKIPPED_EVAL_KEYS = ("eval_samples", "eval_reward_failures", "eval_accuracy_before_sft")
REWARD_WINDOW = 10
# What --table-only keeps from an existing --out: facts about the runs, not about the rebuild.
RUN_FACTS = ("command", "commit", "cpu", "cores", "torch", "parallel", "threads_per_run", "run_seconds")


def eval_keys(rows: list[dict]) -> list[str]:
    """The held-out metrics to tabulate, in log order: greedy `eval_accuracy` and each eval
    suite's overall pass@j (`eval/<suite>/pass@j`, not the per-data-source ones)."""
    keys = []
    for row in rows:
        for key in row:
            overall_pass = key.startswith("eval/") and key.count("/") == 2 and "/pass@" in key
            if (key == "eval_accuracy" or overall_pass) and key not in keys:
                keys.append(key)
    return [k for k in keys if k not in SKIPPED_EVAL_KEYS]


def seed_values(rows: list[dict]) -> dict:
    """One run's numbers: {'before_sft': x or None, 'evals': {step: {key: x}}, 'reward_first',
    'reward_last': mean reward_mean of the first / last 10 RL steps, 'rl_steps'}."""
    rl = [r for r in rows if r.get("phase", "rl") == "rl"]
    keys = eval_keys(rl)
    evals = {}
    for row in rl:
        found = {k: row[k] for k in keys if row.get(k) is not None}
        if found:
            evals.setdefault(row["step"], {}).update(found)
    rewards = [r["reward_mean"] for r in rl if r.get("reward_mean") is not None]
    before = [r[BEFORE_SFT] for r in rows if r.get(BEFORE_SFT) is not None]
    return {
        "before_sft": before[0] if before else None,
        "evals": evals,
        "reward_first": mean(rewards[:REWARD_WINDOW]) if rewards else None,
        "reward_last": mean(rewards[-REWARD_WINDOW:]) if rewards else None,
        "rl_steps": len(rewards),
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(values: list[float]) -> dict:
    """{'mean', 'min', 'max'} of one number over the seeds."""
    return {"mean": mean(values), "min": min(values), "max": max(values)}


def cell(values: list[float]) -> str:
    """'0.412 (0.398-0.430)': the mean over seeds and its range; one seed: just its value."""
    s = summary(values)
    return f"{s['mean']:.3f}" if len(values) == 1 else f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def build_table(per_seed: dict[int, dict]) -> tuple[str, dict]:
    """(markdown table, its numbers) over the seeds' `seed_values`. A row per evaluation step
    that every seed logged; a step some seeds lack (a run stopped early) is an error."""
    assert per_seed, "no seeds to tabulate"
    seeds = sorted(per_seed)
    steps = sorted(set().union(*(v["evals"] for v in per_seed.values())))
    keys = list(dict.fromkeys(k for v in per_seed.values() for at in v["evals"].values() for k in at))
    if not steps:
        raise ValueError("no held-out evaluation in the runs' metrics.jsonl: is metrics.eval_freq set?")
    for seed in seeds:
        missing = [s for s in steps if s not in per_seed[seed]["evals"]]
        if missing:
            raise ValueError(f"seed {seed} has no evaluation at step(s) {missing}: did its run finish?")
    header = ["GRPO step", *keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = []
    befores = [per_seed[s]["before_sft"] for s in seeds]
    if all(b is not None for b in befores):
        lines.append("| before SFT warm-up | " + " | ".join([cell(befores)] + [""] * (len(keys) - 1)) + " |")
        rows.append({"step": "before_sft", "eval_accuracy": summary(befores)})
    for step in steps:
        values = {k: [per_seed[s]["evals"][step][k] for s in seeds if k in per_seed[s]["evals"][step]] for k in keys}
        lines.append(f"| {step} | " + " | ".join(cell(v) if v else "" for v in values.values()) + " |")
        rows.append({"step": step, **{k: summary(v) for k, v in values.items() if v}})
    reward = {
        "first": summary([per_seed[s]["reward_first"] for s in seeds]),
        "last": summary([per_seed[s]["reward_last"] for s in seeds]),
    }
    first, last = ([per_seed[s][f"reward_{w}"] for s in seeds] for w in ("first", "last"))
    lines.append("")
    lines.append(
        f"Mean training reward, first vs last {REWARD_WINDOW} steps: {cell(first)} -> {cell(last)} "
        f"(mean (min-max) over seeds {', '.join(map(str, seeds))})."
    )
    return "\n".join(lines), {"rows": rows, "reward": reward}


def read_seeds(dump_root: str, seeds: list[int]) -> dict[int, dict]:
    """`seed_values` of each seed's `<dump_root>/seed<N>/metrics.jsonl`; ValueError if one is missing."""
    out = {}
    for seed in seeds:
        path = os.path.join(dump_root, f"seed{seed}", "metrics.jsonl")
        if not os.path.exists(path):
            raise ValueError(f"no {path}: run the seeds first (drop --table-only) or pass --dump-root")
        out[seed] = seed_values(load_rows(path))
    return out


def run_command(config: str, seed: int, dump_root: str, overrides: list[str]) -> list[str]:
    folder = os.path.join(dump_root, f"seed{seed}")
    return [sys.executable, "-m", "titanrl.cli", "run", config, f"--job.seed={seed}", f"--job.dump_folder={folder}"] + (
        overrides
    )


def run_seeds(config: str, seeds: list[int], dump_root: str, parallel: int, threads: int, overrides: list[str]) -> dict:
    """Run every seed, `parallel` at a time, `threads` CPU threads each; {seed: seconds}.
    Each run's output goes to `<dump_root>/seed<N>.log`; a failed run is a RuntimeError."""
    for seed in seeds:
        if os.path.exists(os.path.join(dump_root, f"seed{seed}", "metrics.jsonl")):
            raise ValueError(
                f"{dump_root}/seed{seed} already holds a run: remove it, pick another --dump-root, "
                "or rebuild the table from it with --table-only"
            )
    os.makedirs(dump_root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    waiting, running, seconds = list(seeds), {}, {}
    while waiting or running:
        while waiting and len(running) < parallel:
            seed = waiting.pop(0)
            log = open(os.path.join(dump_root, f"seed{seed}.log"), "w")
            cmd = run_command(config, seed, dump_root, overrides)
            print(f"seed {seed}: {' '.join(cmd[1:])} (log {log.name})", flush=True)
            running[seed] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.time())
        time.sleep(2)
        for seed, (proc, log, started) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[seed]
                seconds[seed] = round(time.time() - started, 1)
                if proc.returncode != 0:
                    raise RuntimeError(f"seed {seed} failed with exit code {proc.returncode}: see {log.name}")
                print(f"seed {seed}: done in {seconds[seed]:.0f} s", flush=True)
    return seconds


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the job's TOML (default: the README's main job)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="job.seed of each run")
    parser.add_argument("--parallel", type=int, default=0, help="runs at a time (default: min(seeds, cores))")
    parser.add_argument(
        "--dump-root", default="", help="runs go to <dump-root>/seed<N> (default outputs/seeds/<config>)"
    )
    parser.add_argument("--out", default="", help="JSON file (default docs/results/seeds_<config>.json)")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table from the dump folders")
    args = parser.parse_args(argv)
    stem = os.path.splitext(os.path.basename(args.config))[0]
    args.dump_root = args.dump_root or os.path.join("outputs", "seeds", stem)
    args.out = args.out or os.path.join("docs", "results", f"seeds_{stem}.json")
    if args.parallel < 0:
        raise SystemExit(f"seed_table.py: --parallel {args.parallel}: give a positive number of runs at a time")
    return args, overrides


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_args(argv)
    cores = os.cpu_count() or 1
    parallel = args.parallel or max(1, min(len(args.seeds), cores))
    threads = max(1, cores // parallel)
    seconds = {}
    if not args.table_only:
        print(f"{len(args.seeds)} seeds, {parallel} at a time, {threads} thread(s) each on {cores} cores", flush=True)
        seconds = run_seeds(args.config, args.seeds, args.dump_root, parallel, threads, overrides)
    per_seed = read_seeds(args.dump_root, args.seeds)
    table, numbers = build_table(per_seed)
    print(table)
    record = {
        "config": args.config,
        "command": "python scripts/seed_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit(),
        "cpu": cpu_model(),
        "cores": cores,
        "torch": torch.__version__,
        "parallel": None if args.table_only else parallel,
        "threads_per_run": None if args.table_only else threads,
        "run_seconds": {str(s): v for s, v in seconds.items()},
        "table_markdown": table,
        **numbers,
        "per_seed": {str(s): {**v, "evals": {str(k): e for k, e in v["evals"].items()}} for s, v in per_seed.items()},
    }
    if args.table_only and os.path.exists(args.out):  # keep how the runs were made
        with open(args.out) as f:
            made = json.load(f)
        record.update({k: made[k] for k in RUN_FACTS if k in made})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

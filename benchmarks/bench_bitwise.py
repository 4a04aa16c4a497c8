"""Cost of bitwise generator/trainer parity (`generator.batch_invariant=true`) on the README's main job.

    python -m benchmarks.bench_bitwise --out benchmarks/bench_bitwise.json [--steps 4] [--reps 1]

One process builds one Trainer per variant from `train_configs/grpo_reverse_debug.toml` (32 prompts
x 8 samples, 8 new tokens, debug model; `--sft_warmup.steps=0` so the untrained model samples
full-length completions, and no eval) and runs their RL steps alternately (A, B, C, A, B, C, ...),
so that load from other processes spreads over all variants. The first step of each variant is
dropped (warm-up); the medians of the per-phase times over the rest are reported: `normal`
(`generator.batch_invariant=false`) and `bitwise` (true). The implementation before 2026-12-03
(every matmul an elementwise product + sum, attention one query at a time) measured ~12x
(generate) and ~40x (train) under load; `earlier_runs` in the JSON keeps such runs.

Every bitwise variant must log `gen_logprob_diff == 0` (checked).
"""

import argparse
import functools
import json
import os
import statistics

from benchmarks.harness import REPO_ROOT, read_results, timed_call, write_json
from titanrl.config import load_config
from titanrl.train import build_trainer

PHASES = ["sync", "generate", "reward", "logprob", "train"]
# The main results as docs/benchmarks.md tabulates them: (title, path into the results, columns).
DOC_TABLES = [
    ("Median seconds per RL step phase", ["median_s"], None),
    ("Bitwise over normal, medians", ["ratio_to_normal"], None),
    ("Bitwise over normal, minima (the least disturbed steps)", ["min_ratio_to_normal"], None),
]


def _earlier_run(path: str) -> dict:
    """An earlier JSON of this script, its own earlier runs left out, with the commit that made it."""
    results, commit = read_results(path)
    return {"commit": commit, **{k: v for k, v in results.items() if k != "earlier_runs"}}


def measure(base: list[str], variants: list[str], steps: int, reps: int) -> dict[str, list[dict]]:
    """Each variant's per-step phase seconds: `reps` fresh trainers per variant, their steps
    alternating; the first step of each trainer dropped."""
    rows = {v: [] for v in variants}
    for rep in range(reps):
        trainers = {}
        for v in variants:
            dump = os.path.join("/tmp", f"bench_bitwise_{os.getpid()}_{rep}_{v}")
            trainers[v] = build_trainer(
                load_config(
                    [*base, f"--job.dump_folder={dump}", f"--generator.batch_invariant={str(v != 'normal').lower()}"]
                )
            )
        loaders = {v: iter(t.recipe.loader) for v, t in trainers.items()}
        for step in range(1, steps + 1):
            for v, t in trainers.items():
                wall, m = timed_call(functools.partial(t.recipe.step, loaders[v], step))
                if v != "normal" and m["gen_logprob_diff"] != 0.0:
                    raise AssertionError(f"{v}: generator and trainer logprobs differ ({m['gen_logprob_diff']})")
                row = {ph: m.get(f"time_{ph}", 0.0) for ph in PHASES}
                row.update(step=step, wall=wall, gen_logprob_diff=m["gen_logprob_diff"], response_len=m["response_len"])
                times = " ".join(f"{k} {row[k]:.3f}" for k in ["generate", "train", "wall"])
                print(f"rep {rep} step {step} {v:22s} {times}", flush=True)
                if step > 1:
                    rows[v].append(row)
        for t in trainers.values():
            t.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="RL steps per variant (the first is dropped)")
    p.add_argument("--reps", type=int, default=1, help="fresh trainers per variant (steps alternate within a rep)")
    p.add_argument("--extra", nargs="*", default=[], help="more --section.key=value overrides for every variant")
    p.add_argument("--include", nargs="*", default=[], help="earlier JSON results of this script to keep in --out")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = ["normal", "bitwise"]
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
    base = [
        f"--job.config_file={config}",
        "--sft_warmup.steps=0",
        f"--training.steps={a.steps}",
        "--metrics.eval_freq=0",
        "--data.num_eval_samples=8",
        "--job.print_config=false",
        *a.extra,
    ]
    rows = measure(base, variants, a.steps, a.reps)
    # Load from other processes only adds time: the minimum is the least disturbed step.
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in [*PHASES, "wall"]} for v, rs in rows.items()}
    minimum = {v: {k: min(r[k] for r in rs) for k in [*PHASES, "wall"]} for v, rs in rows.items()}
    ratios = {
        v: {k: summary[v][k] / summary["normal"][k] for k in ["generate", "train", "wall"]}
        for v in variants
        if v != "normal"
    }
    min_ratios = {
        v: {k: minimum[v][k] / minimum["normal"][k] for k in ["generate", "train", "wall"]}
        for v in variants
        if v != "normal"
    }
    result = {
        "job": "train_configs/grpo_reverse_debug.toml " + " ".join(base[1:]),
        "method": "variants alternate step by step in one process; first step of each trainer dropped; "
        "medians and minima over the other steps (s)",
        "median_s": summary,
        "ratio_to_normal": ratios,
        "min_s": minimum,
        "min_ratio_to_normal": min_ratios,
        "steps": rows,
        "earlier_runs": [_earlier_run(f) for f in a.include],
    }
    print(json.dumps({"median_s": summary, "ratio_to_normal": ratios, "min_ratio_to_normal": min_ratios}, indent=2))
    if a.out:
        write_json(a.out, result)


if __name__ == "__main__":
    main()

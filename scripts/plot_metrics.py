"""Plot the metrics.jsonl of one or more titanrl runs as a grid of panels, saved as a PNG.

    python scripts/plot_metrics.py outputs/grpo_reverse_debug/metrics.jsonl --out docs/reward_curve.png
    python scripts/plot_metrics.py outputs/a/metrics.jsonl outputs/b/metrics.jsonl --out compare.png

RL runs: reward (mean, with a +-std band for a single run), accuracy (train line, held-out eval
as markers), KL, entropy, response length, seconds per phase (every time_* key) and the SFT
warm-up loss (its steps are negative). Offline recipes (sft / dpo / reward_model): loss, margin and preference
accuracy, each with its held-out eval_* as markers. Only panels whose metrics exist are drawn;
several files overlay, one line style per run. `--keys a,b` draws just those metrics instead.

A resumed run appends to its file and redoes the steps after its last checkpoint, so the last row
of each (phase, step) wins. A torn last line (the run was killed mid-write) is skipped with a warning.

Needs matplotlib, the optional 'plot' extra: pip install -e ".[plot]".
"""

import argparse
import json
import math
import os
import sys

# (title, metric keys, y axis from 0). A key ending in "*" stands for every key with that prefix.
# Keys prefixed "eval_" are held-out evaluations, logged only every few steps: drawn as markers.
# eval_accuracy_before_sft is left out: its one point at the first warm-up step (-sft_warmup.steps)
# would stretch the accuracy panel's x axis far left of the RL steps.
PANELS = [
    ("reward", ["reward_mean"], True),
    ("accuracy", ["accuracy", "eval_accuracy"], True),
    ("KL to reference", ["kl"], False),
    ("entropy", ["entropy"], False),
    ("response length (tokens)", ["response_len"], True),
    ("seconds per step, by phase", ["time_*"], True),
    ("SFT warm-up loss", ["sft_loss"], False),
    ("loss", ["loss", "eval_loss"], False),
    ("margin (chosen - rejected)", ["margin", "eval_margin"], False),
    ("preference accuracy", ["pref_accuracy", "eval_pref_accuracy"], True),
]
LINESTYLES = ["-", "--", ":", "-."]
MISSING_MATPLOTLIB = "plot_metrics.py needs the 'plot' extra: pip install -e \".[plot]\" (or pip install matplotlib)"


def load_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, one per (phase, step) with the last one winning, sorted by step."""
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    latest = {}
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as e:
            if i == len(lines) - 1:  # a killed run can leave half a line; everything before it is good
                print(f"warning: {path}:{n}: skipping torn last line ({e})", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{n}: malformed metrics line: {e}") from None
        latest[(row.get("phase"), row["step"])] = row  # a step redone after a resume replaces the old one
    return sorted(latest.values(), key=lambda r: r["step"])  # stable: same-step rows keep log order


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `key`."""
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def expand(keys: list[str], present: list[str]) -> list[str]:
    """Panel keys with each "prefix*" replaced by the present keys of that prefix, in log order."""
    out = []
    for key in keys:
        out += [k for k in present if k.startswith(key[:-1])] if key.endswith("*") else [key]
    return [k for k in out if k in present]


def run_name(path: str) -> str:
    """outputs/grpo_reverse_debug/metrics.jsonl -> grpo_reverse_debug."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or os.path.basename(path)


def import_pyplot():
    try:
        import matplotlib
    except ImportError:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")  # files only: no display needed on a headless training node
    import matplotlib.pyplot as plt

    return plt


def draw_panel(ax, title: str, keys: list[str], from_zero: bool, runs: dict[str, list[dict]]) -> None:
    lowest = math.inf
    for r, (name, rows) in enumerate(runs.items()):
        for k, key in enumerate(keys):
            steps, values = series(rows, key)
            if not steps:
                continue
            label = key if len(runs) == 1 else f"{key} [{name}]"
            marker = {"marker": "o", "markersize": 4} if key.startswith("eval_") else {}
            colour = f"C{(r * len(keys) + k) % 10}"  # a colour per line; a line style per run too
            ax.plot(steps, values, linestyle=LINESTYLES[r % len(LINESTYLES)], color=colour, label=label, **marker)
            if key == "reward_mean":  # the spread of rewards within a batch, when logged
                std_steps, std = series(rows, "reward_std")
                if std_steps == steps and len(runs) == 1:
                    ax.fill_between(
                        steps,
                        [m - s for m, s in zip(values, std)],
                        [m + s for m, s in zip(values, std)],
                        color="C0",
                        alpha=0.15,
                        linewidth=0,
                        label="± reward_std",
                    )
            lowest = min(lowest, *values)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.locator_params(axis="x", integer=True)  # steps are whole numbers
    ax.grid(alpha=0.3)
    if from_zero:  # rewards, accuracies, lengths, seconds: their size is read against 0
        ax.set_ylim(bottom=min(0.0, lowest))
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(fontsize="small")


def plot(runs: dict[str, list[dict]], panels: list[tuple[str, list[str], bool]], out: str, title: str) -> None:
    plt = import_pyplot()
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, *panel, runs)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl file(s) of titanrl runs")
    parser.add_argument("--out", default="metrics.png", help="PNG to write")
    parser.add_argument("--keys", default=None, help="comma-separated metrics, one panel each (default: all known)")
    args = parser.parse_args(argv)
    import_pyplot()  # fail on a missing extra before reading anything
    runs = {}
    for path in args.metrics:
        try:
            rows = load_rows(path)
        except ValueError as e:
            sys.exit(f"plot_metrics.py: {e}")
        runs[path if run_name(path) in runs else run_name(path)] = rows  # the path when names clash
    present = list(dict.fromkeys(k for rows in runs.values() for r in rows for k in r))
    candidates = [(k, [k], False) for k in args.keys.split(",")] if args.keys else PANELS
    panels = [(t, expand(keys, present), zero) for t, keys, zero in candidates if expand(keys, present)]
    if not panels:
        sys.exit(f"plot_metrics.py: no plottable metrics in {', '.join(args.metrics)}")
    plot(runs, panels, args.out, title=" vs ".join(runs))
    print(f"wrote {args.out}: " + ", ".join(t for t, _, _ in panels))


if __name__ == "__main__":
    main()

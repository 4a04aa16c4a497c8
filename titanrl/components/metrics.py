"""Rank-0 metrics: console line, JSONL file, and (optionally) Weights & Biases.

wandb is never required: it is imported only when enabled and runs offline unless configured.
"""

import json
import math
import os
import time
from typing import Any

import torch

from titanrl.config.job_config import JobConfig


class MetricsLogger:
    def __init__(self, job_config: JobConfig, rank: int, append: bool = False) -> None:
        """`append` continues an existing metrics file (a resumed run) instead of starting it anew."""
        self.enabled = rank == 0
        self.jsonl = None
        self.wandb_run = None
        if not self.enabled:
            return
        cfg = job_config.metrics
        os.makedirs(job_config.job.dump_folder, exist_ok=True)
        if cfg.jsonl_file:
            self.jsonl = open(os.path.join(job_config.job.dump_folder, cfg.jsonl_file), "a" if append else "w")
        if cfg.enable_wandb:
            import wandb

            self.wandb_run = wandb.init(
                project="titanrl",
                name=job_config.job.description,
                mode=cfg.wandb_mode,
                dir=job_config.job.dump_folder,
            )

    def log(self, step: int, metrics: dict[str, Any], console: dict[str, str] | None = None) -> None:
        """Record `metrics` for `step`; print the keys of `console` (key -> short label), or all."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        labels = console if console is not None else {k: k for k in metrics}
        parts = [f"{label} {_duration(record[k]) if k == 'eta_s' else _fmt(record[k])}"
                 for k, label in labels.items() if k in record]
        print(f"step {step:>4} | " + " | ".join(parts), flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"

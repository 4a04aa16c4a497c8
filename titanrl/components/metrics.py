"""Rank-0 metrics: console line, JSONL file, and (optionally) Weights & Biases.

wandb is never required: it is imported only when enabled and runs offline unless configured.
"""

import json
import math
import os
import time
import uuid
from typing import Any

import torch

from titanrl.components.console import get_logger
from titanrl.config.job_config import JobConfig

log = get_logger(__name__)


class MetricsLogger:
    def __init__(self, job_config: JobConfig, rank: int, append: bool = False) -> None:
        """`append` continues an existing metrics file (a resumed run) instead of starting it anew."""
        self.enabled = rank == 0
        self.jsonl = None
        self.wandb_run = None
        if not self.enabled:
            return
        cfg, folder = job_config.metrics, job_config.job.dump_folder
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, cfg.jsonl_file) if cfg.jsonl_file else ""
        if self.path:
            self.jsonl = open(self.path, "a" if append else "w")
        if cfg.enable_wandb:
            import wandb

            self.wandb_run = wandb.init(
                project="titanrl",
                name=job_config.job.description,
                mode=cfg.wandb_mode,
                dir=folder,
                # A resumed run continues the same wandb run instead of starting a second one.
                id=_wandb_run_id(folder, append),
                resume="allow",
            )

    def keep_through(self, step: int) -> None:
        """Drop the rows after `step` (and a torn last line) from the metrics file: a resumed run
        redoes the steps after its checkpoint, and each step must appear once."""
        if self.jsonl is None:
            return
        self.jsonl.close()
        rows = [row for row in read_metrics(self.path) if row.get("step", 0) <= step]
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(self.path + ".tmp", self.path)
        self.jsonl = open(self.path, "a")

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
        parts = [
            f"{label} {_duration(record[k]) if k == 'eta_s' else _fmt(record[k])}"
            for k, label in labels.items()
            if k in record
        ]
        log.info(f"step {step:>4} | " + " | ".join(parts))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file. A torn last line (the run was killed mid-write) is
    skipped; a broken line before the end is an error naming it."""
    with open(path, encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != lines[-1][0]:
                raise ValueError(f"{path}:{i} is not a JSON row; the metrics file is damaged") from None
    return rows


def _wandb_run_id(folder: str, resume: bool) -> str:
    """The wandb run id kept in the dump folder: reused when the run resumes, new otherwise."""
    path = os.path.join(folder, "wandb_run_id")
    if resume and os.path.exists(path):
        return open(path).read().strip()
    run_id = uuid.uuid4().hex[:8]
    with open(path, "w") as f:
        f.write(run_id)
    return run_id


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

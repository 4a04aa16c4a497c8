"""Metrics: JSONL records, console labels, and wandb in offline mode (never needs a network)."""

import json
import os

from titanrl.components.metrics import MetricsLogger
from titanrl.config import JobConfig


def test_jsonl_console_and_rank0_only(tmp_path, capsys):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    logger = MetricsLogger(cfg, rank=0)
    logger.log(1, {"reward_mean": 0.5, "lr": 1e-5, "tokens_per_s": 1234.5}, {"reward_mean": "reward", "lr": "lr"})
    logger.close()
    out = capsys.readouterr().out
    assert out.strip() == "step    1 | reward 0.500 | lr 1.00e-05"
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert record["step"] == 1 and record["tokens_per_s"] == 1234.5
    other = MetricsLogger(cfg, rank=1)
    other.log(2, {"x": 1.0})
    assert capsys.readouterr().out == ""


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.enable_wandb = True
    logger = MetricsLogger(cfg, rank=0)
    logger.log(1, {"reward_mean": 0.25})
    logger.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1

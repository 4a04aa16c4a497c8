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


def test_resume_keeps_each_step_once_and_skips_a_torn_last_line(tmp_path):
    """metrics.jsonl of a run killed mid-write (torn last line), resumed from its step-2 checkpoint -> the rows after step 2 and the torn line are dropped, each step appears once; readers skip a torn last line and name a broken line before it"""
    import pytest

    from titanrl.components.metrics import read_metrics

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    first = MetricsLogger(cfg, rank=0)
    for step in range(4):
        first.log(step, {"reward_mean": step / 10})
    first.close()
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 4, "reward_m')  # killed mid-write
    assert [r["step"] for r in read_metrics(str(path))] == [0, 1, 2, 3]
    resumed = MetricsLogger(cfg, rank=0, append=True)
    resumed.keep_through(2)
    for step in (3, 4):
        resumed.log(step, {"reward_mean": 1.0})
    resumed.close()
    rows = read_metrics(str(path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[3]["reward_mean"] == 1.0
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{torn", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a JSON row"):
        read_metrics(str(path))


def test_wandb_resumes_the_same_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.metrics.enable_wandb = True
    ids = []
    for append in (False, True):
        logger = MetricsLogger(cfg, rank=0, append=append)
        ids.append(logger.wandb_run.id)
        logger.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_run_id").read_text()
    fresh = MetricsLogger(cfg, rank=0, append=False)
    assert fresh.wandb_run.id != ids[0]
    fresh.close()

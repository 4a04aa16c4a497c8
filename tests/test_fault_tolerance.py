"""Fault tolerance across replica groups with TorchFT (`[fault_tolerance]`, `titanrl run
--ft-replicas N`): each test's docstring is one row of the table in docs/reliability.md."""

import json
import os
import subprocess
import sys
import time

import pytest
from helpers.launch import REPO_ROOT, run_cmd, torchrun_cmd, train_cmd
from helpers.tiny import smoke_run_args
from safetensors.torch import load_file

from titanrl.components.ft_launch import free_port, lighthouse_cmd, replica_args

pytest.importorskip("torchft")

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("TITANRL_FAULT", None)


def _args(*extra, steps=4):
    return smoke_run_args("--checkpoint.export_hf=true", *extra, config=None, steps=steps, sft_steps=3)


def _rows(folder) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if r.get("phase") == "rl" and "reward_mean" in r]


def _weights(folder):
    return load_file(os.path.join(folder, "hf", "model.safetensors"))


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multirank
def test_two_replica_groups_equal_a_dp_replicate_2_run(tmp_path):
    """`titanrl run --ft-replicas 2` (lighthouse + 2 replica groups of 1 rank), no failure -> every step's grad norm and rewards equal a 2-rank dp_replicate = 2 run's to float rounding, the final weights within 1e-5, and both replica groups hold bitwise the same weights"""
    ft = tmp_path / "ft"
    # min_replicas = 2: no step without both groups (with 1, a group that starts late heals into the run)
    args = _args(f"--job.dump_folder={ft}", "--fault_tolerance.min_replicas=2")
    cmd = [sys.executable, "-m", "titanrl.cli", "run", "--ft-replicas", "2", CONFIG, *args]
    proc = run_cmd(cmd, ENV, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = tmp_path / "ref"
    args = [f"--job.config_file={CONFIG}", *_args(f"--job.dump_folder={ref}", "--parallelism.dp_replicate=2")]
    proc = run_cmd([*torchrun_cmd(2), "-m", "titanrl.train", *args], ENV, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1, dp = _rows(ft / "replica_0"), _rows(ft / "replica_1"), _rows(ref)
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == [r["step"] for r in dp] == [1, 2, 3, 4]
    assert all(r["ft_quorum"] == 2 for r in r0 + r1)
    for a, b, c in zip(r0, r1, dp):
        assert a["grad_norm"] == b["grad_norm"] and abs(a["grad_norm"] - c["grad_norm"]) <= 1e-6 * max(1, c["grad_norm"])
        assert (a["reward_mean"] + b["reward_mean"]) / 2 == pytest.approx(c["reward_mean"], abs=1e-7)
    assert _max_diff(_weights(ft / "replica_0"), _weights(ft / "replica_1")) == 0.0
    assert _max_diff(_weights(ft / "replica_0"), _weights(ref)) < 1e-5

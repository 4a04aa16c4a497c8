"""Two simulated nodes on localhost: two torchrun launches (--nnodes=2, 2 ranks each) joined by a
c10d rendezvous run GRPO steps with HSDP across the "nodes" and match a 1-rank run; the Slurm
script (scripts/deploy/multinode_trainer.slurm) makes that launch on a cluster."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile

import pytest
from helpers.launch import REPO_ROOT, run_cmd
from helpers.tiny import smoke_run_args
from torch.distributed.run import get_args_parser

from titanrl.cli import split_args

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
SLURM = os.path.join(REPO_ROOT, "scripts", "deploy", "multinode_trainer.slurm")
SMALL = smoke_run_args(steps=2, sft_steps=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rl(folder):
    rows = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    return [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]


@pytest.mark.multirank
def test_two_localhost_nodes_match_one_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    proc = run_cmd([sys.executable, "-m", "titanrl.train", *SMALL, f"--job.dump_folder={one}"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    nodes = tmp_path / "nodes"
    port = _free_port()
    launches = []
    for node_rank in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=titanrl-test",
            "-m",
            "titanrl.train",
            *SMALL,
            f"--job.dump_folder={nodes}",
            "--parallelism.dp_replicate=2",
            "--parallelism.dp_shard=2",
        ]
        log = tempfile.TemporaryFile("w+")
        launches.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=REPO_ROOT), log))
    for proc, log in launches:
        code = proc.wait(timeout=600)
        log.seek(0)
        assert code == 0, log.read()[-4000:]

    got, want = _rl(nodes), _rl(one)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6)
        assert g["response_len"] == pytest.approx(w["response_len"], abs=1e-6)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)


def test_slurm_script_makes_this_launch():
    """The Slurm script runs `titanrl run` as one torchrun per node joined by a c10d rendezvous,
    as above, with options torchrun accepts, restarts, and SIGUSR1 (its --signal) handled."""
    with open(SLURM) as f:
        text = f.read()
    assert "#SBATCH --signal=USR1@" in text
    line = text[text.index("srun titanrl run") :].replace("\\\n", " ").split("\n")[0]
    env = {
        "SLURM_NNODES": "4",
        "GPUS_PER_NODE": "8",
        "SLURM_JOB_ID": "7",
        "HEAD_NODE_IP": "10.0.0.1",
        "CONFIG_FILE": CONFIG,
    }
    argv = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], line.replace('"$@"', "")))
    assert argv[:3] == ["srun", "titanrl", "run"]
    opts, config_file, overrides = split_args(argv[3:])
    assert config_file == CONFIG and overrides == []
    cli = get_args_parser().parse_args([*opts, "-m", "titanrl.train"])  # an unknown option exits here
    assert (cli.nnodes, cli.nproc_per_node, cli.rdzv_id) == ("4", "8", "7")
    assert cli.rdzv_backend == "c10d" and cli.rdzv_endpoint == "10.0.0.1:29500"
    assert cli.max_restarts >= 1 and "SIGUSR1" in cli.signals_to_handle.split(",")

"""Running titanrl the way users do, from tests: a job's command line, torchrun with gloo ranks,
and subprocesses whose output goes to files."""

import os
import subprocess
import sys
import tempfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cmd(cmd: list[str], env: dict, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run a command with its output in files, not pipes: a stray grandchild that keeps an
    inherited pipe open (e.g. after a SIGKILL test) can then never hang the test."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=err, text=True, timeout=timeout_s, cwd=REPO_ROOT)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def train_cmd(args: list[str], nproc: int = 1) -> list[str]:
    """The command line of a titanrl job: `python -m titanrl.train` on one rank, else under
    `torchrun --standalone` with `nproc` ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "titanrl.train", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "titanrl.train",
        *args,
    ]


def run_torchrun(script: str, nproc: int, args: list[str], timeout_s: float = 600) -> str:
    """Run `script` under `torchrun --standalone` with `nproc` gloo ranks; fail with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    proc = run_cmd(cmd, env, timeout_s)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"torchrun {os.path.basename(script)} exited {proc.returncode}:\n{output[-6000:]}")
    return output

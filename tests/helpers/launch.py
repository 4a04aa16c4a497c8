"""Running titanrl the way users do, from tests: a job's command line, torchrun with gloo ranks,
and subprocesses whose output goes to files."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The path of ranks that import `helpers....` and test modules besides titanrl.
TESTS_PYTHONPATH = os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")])
JOBS_WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "jobs_worker.py")


def run_cmd(cmd: list[str], env: dict, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run a command with its output in files, not pipes: a stray grandchild that keeps an
    inherited pipe open (e.g. after a SIGKILL test) can then never hang the test. A titanrl job
    (`python -m titanrl.train`, alone or under `torchrun --standalone`) and a torchrun'd script
    run on ranks forked from pre-imported interpreters (`_run_forked`)."""
    forked = _forkable(cmd)
    if forked is not None and os.environ.get("TITANRL_TEST_TORCHRUN") != "1":
        return _run_forked(cmd, *forked, env, timeout_s)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=err, text=True, timeout=timeout_s, cwd=REPO_ROOT)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def _forkable(cmd: list[str]) -> tuple[list[str], int] | None:
    """(the `python` arguments, ranks) of a command `rank_zygote` runs as it would run, else None."""
    if cmd[:3] == [sys.executable, "-m", "titanrl.train"]:
        return cmd[1:], 1
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    # Only the launch options run_torchrun and train_cmd give: other torchrun flags (restarts,
    # rendezvous settings) are torchrun's own behaviour, so those commands run torchrun.
    if cmd[:4] == torchrun and cmd[4].startswith("--nproc_per_node=") and not cmd[5].startswith("--"):
        return cmd[5:], int(cmd[4].split("=")[1])
    return None


def _run_forked(
    cmd: list[str], argv: list[str], nproc: int, env: dict, timeout_s: float
) -> subprocess.CompletedProcess:
    """`cmd` on ranks forked by helpers/rank_zygote.py. Its exit code is the process's (one rank
    without torchrun) or torchrun's: 0 when every rank exits 0, else 1."""
    from helpers import rank_zygote

    with tempfile.TemporaryDirectory() as logs:
        codes, out, err = rank_zygote.launch(argv, nproc, env, timeout_s, logs, torchrun=cmd[2] != "titanrl.train")
    code = codes[0] if cmd[2] == "titanrl.train" else int(any(codes))
    return subprocess.CompletedProcess(cmd, code, out, err)


def torchrun_cmd(nproc: int) -> list[str]:
    """`torchrun --standalone` with `nproc` ranks, as this interpreter's module."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def train_cmd(args: list[str], nproc: int = 1) -> list[str]:
    """The command line of a titanrl job: `python -m titanrl.train` on one rank, else under
    `torchrun --standalone` with `nproc` ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "titanrl.train", *args]
    return [*torchrun_cmd(nproc), "-m", "titanrl.train", *args]


def run_torchrun(script: str, nproc: int, args: list[str], timeout_s: float = 600, env: dict | None = None) -> str:
    """Run `script` on `nproc` gloo ranks as `torchrun --standalone` would (`env`: variables to
    add or replace); fail with its output. The ranks are forked from pre-imported interpreters
    (helpers/rank_zygote.py); TITANRL_TEST_TORCHRUN=1 starts them with torchrun instead."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT, **(env or {})}
    cmd = [*torchrun_cmd(nproc), script, *args]
    proc = run_cmd(cmd, env, timeout_s)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"torchrun {os.path.basename(script)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


def run_train_jobs(jobs: list[list[str]], nproc: int, folder, env: dict | None = None) -> str:
    """Several jobs' `titanrl.train` arguments run one after the other in one torchrun launch of
    `nproc` ranks (tests/multirank/jobs_worker.py): each further job skips every rank's
    interpreter start-up. tests/ is on the path (for `helpers....` and `test_...` functions a job
    names); `env` as `run_torchrun`. Fails with the output if any job fails."""
    env = {"PYTHONPATH": TESTS_PYTHONPATH, **(env or {})}
    return run_torchrun(JOBS_WORKER, nproc, jobs_worker_args(jobs, folder), env=env)


def jobs_worker_args(jobs: list[list[str]], folder) -> list[str]:
    """JOBS_WORKER's arguments for `jobs` (each a `titanrl.train` argument list), written to
    `folder`/jobs.json."""
    path = os.path.join(folder, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    return ["--jobs", path]


def train_here(argv: list[str]) -> str:
    """`python -m titanrl.train <argv>` on one rank in this process (no interpreter start-up), on
    one thread as a rank started with OMP_NUM_THREADS=1; returns what it printed."""
    import contextlib
    import io

    import torch

    from titanrl import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            train.main(argv)
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


def _exit_code(call) -> int:
    try:
        return call()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def cli_in_process(argv: list[str], capsys) -> subprocess.CompletedProcess:
    """`titanrl <argv>` in this process, its exit code and output as `run_cmd` returns them: for
    what the launcher checks before any rank starts (an interpreter start-up is seconds)."""
    from titanrl import cli

    capsys.readouterr()  # only this command's output
    code = _exit_code(lambda: cli.main(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["titanrl", *argv], code, out.out, out.err)


def train_in_process(argv: list[str], capsys) -> subprocess.CompletedProcess:
    """`python -m titanrl.train <argv>` in this process (its entry point: a user error exits 2 with
    one line), as `run_cmd` returns it: for a job that stops before it trains."""
    from titanrl import train
    from titanrl.components import launch

    capsys.readouterr()
    code = _exit_code(lambda: launch.run(lambda: train.main(argv)) or 0)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["titanrl.train", *argv], code, out.out, out.err)


def train_metrics(args: list[str], dump_folder) -> list[dict]:
    """Build the trainer of `args` in this process, train, close it, and return the rows of
    `dump_folder`/metrics.jsonl (what `titanrl run` does on one rank, without a launch)."""
    from titanrl.config import load_config
    from titanrl.train import build_trainer

    trainer = build_trainer(load_config(args))
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(os.path.join(str(dump_folder), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

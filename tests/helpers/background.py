"""Subprocess jobs whose results tests read and whose inputs no test changes (mypy, the import
check, the SmolLM2 conversion, the fixed multi-rank launches of the parity modules), run in the
background on the core that the in-process tests leave idle (most of the suite is single-threaded
Python) instead of in series with them.

A test module registers its jobs when it is imported (collected). When collection finishes
(conftest.py's `pytest_collection_finish`), one background lane runs the jobs of the collected
tests one after the other, in the order their first users were collected; `result(name)` waits
for a job, starting it at once if the lane has not reached it yet (or when the module is run
alone without the hook). Jobs run at a lower priority (nice 10), so they take idle time and
barely slow the tests that run meanwhile, and on one intra-op thread (OMP_NUM_THREADS=1 unless the
job sets it), as the test process and every rank: two OpenMP threads sharing the one core left
would wait for each other at every op. Their output goes to files (a full pipe would stall a job
nobody reads yet). Jobs still running when the session ends are killed.
"""

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import launch

REPO_ROOT = launch.REPO_ROOT
_FOLDER = tempfile.mkdtemp(prefix="titanrl-test-jobs-")


@dataclass(frozen=True)
class Job:
    users: tuple[str, ...]
    """Node-id prefixes of the tests that read the job's result (its place in the lane)."""
    command: Callable[[str], list[str]]
    """The command line, given the job's own empty folder (for its outputs)."""
    env: dict[str, str]
    """Variables added to this process's environment (after OMP_NUM_THREADS=1)."""


@dataclass
class _Running:
    proc: subprocess.Popen
    folder: str
    out: str
    err: str


JOBS: dict[str, Job] = {}
_RUNNING: dict[str, _Running] = {}
_LOCK = threading.Lock()


def register(
    name: str, users: tuple[str, ...], command: Callable[[str], list[str]], env: dict[str, str] | None = None
) -> None:
    """Declare a job (at a test module's import, i.e. collection): its users and command line."""
    JOBS[name] = Job(users, command, env or {})


def register_torchrun(name: str, users: tuple[str, ...], script: str, nproc: int, args: Callable[[str], list[str]]):
    """A job that runs `script` on `nproc` gloo ranks under `torchrun --standalone`, with the
    environment `launch.run_torchrun` gives its ranks (`args`: given the job's folder)."""
    env = {"PYTHONPATH": launch.TESTS_PYTHONPATH}
    register(name, users, lambda folder: [*launch.torchrun_cmd(nproc), script, *args(folder)], env)


def register_train_jobs(name: str, users: tuple[str, ...], jobs: Callable[[str], list[list[str]]], nproc: int):
    """A job that runs several `titanrl.train` jobs (`jobs`: their arguments, given the job's
    folder) one after the other in one torchrun launch, as `launch.run_train_jobs` does."""
    register_torchrun(
        name, users, launch.JOBS_WORKER, nproc, lambda folder: launch.jobs_worker_args(jobs(folder), folder)
    )


def _start(name: str) -> _Running:
    """Start registered job `name` (once); call under _LOCK."""
    if name not in _RUNNING:
        folder = os.path.join(_FOLDER, name)
        os.makedirs(folder)
        out, err = os.path.join(_FOLDER, f"{name}.out"), os.path.join(_FOLDER, f"{name}.err")
        job = JOBS[name]
        with open(out, "w") as out_f, open(err, "w") as err_f:
            proc = subprocess.Popen(
                ["nice", "-n", "10", *job.command(folder)],
                cwd=REPO_ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", **job.env},
                stdout=out_f,
                stderr=err_f,
                start_new_session=True,  # its own process group: killed with its ranks
            )
        _RUNNING[name] = _Running(proc, folder, out, err)
    return _RUNNING[name]


def start_for(node_ids: list[str]) -> None:
    """Run, one after the other in a background thread, every job that one of the collected tests
    `node_ids` reads, in the order of its first user."""
    order: list[str] = []
    for node in node_ids:
        order += [name for name, job in JOBS.items() if name not in order and node.startswith(job.users)]
    threading.Thread(target=_lane, args=(order,), name="test-jobs", daemon=True).start()


def _lane(order: list[str]) -> None:
    for name in order:
        with _LOCK:
            job = _start(name)
        job.proc.wait()


def result(name: str, timeout_s: float = 900) -> tuple[subprocess.CompletedProcess, Path]:
    """(the finished job's exit code and output, its folder), starting it first if needed."""
    with _LOCK:
        job = _start(name)
    job.proc.wait(timeout=timeout_s)
    with open(job.out) as out, open(job.err) as err:
        done = subprocess.CompletedProcess(job.proc.args, job.proc.returncode, out.read(), err.read())
    return done, Path(job.folder)


def torchrun_result(name: str, timeout_s: float = 900) -> Path:
    """The folder of a finished `register_torchrun` job; fails the test with its output if a rank failed."""
    done, folder = result(name, timeout_s)
    if done.returncode != 0:
        pytest.fail(f"torchrun job {name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}")
    return folder


@atexit.register
def _stop_all() -> None:
    for job in _RUNNING.values():
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
    shutil.rmtree(_FOLDER, ignore_errors=True)

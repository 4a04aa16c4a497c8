"""Gloo ranks forked from interpreters that have already imported torch and titanrl.

A torchrun launch spends most of a small test's time starting interpreters: the launcher's, then
each rank's (torch, torch.distributed and titanrl.train take seconds each, and 2-4 ranks start
on 2 cores at once). Here each rank index has one long-lived "zygote" process that imports them
once per test session; a launch forks one child per rank, which runs the worker script as
`__main__` with the environment torchrun would give it (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, OMP_NUM_THREADS=1). The ranks are real processes joined by real gloo
collectives, as in PyTorch's own multi-process tests; only the interpreter start-up is shared.
Each zygote starts with its own PYTHONHASHSEED, so ranks still disagree on string-hash order as
separately started ranks do. The launcher itself (torchrun, `titanrl run`) is tested where it is
the subject: tests/test_launch_hygiene.py, tests/test_multinode.py, tests/test_cli.py.

`TITANRL_TEST_TORCHRUN=1` in the environment makes `helpers.launch.run_torchrun` use torchrun.

Protocol: one JSON request per line on the zygote's stdin, one JSON answer per line on its
stdout (the zygote's own prints go to stderr).
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(TESTS)
PRELOAD = ("torch", "torch.distributed", "titanrl.train")


# ---- the zygote (a process of its own) ---------------------------------------------------------


def _serve() -> dict:
    """Answer requests until a fork: returns the job in the forked child; exits in the zygote."""
    import ctypes
    import importlib

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the test session
    for name in PRELOAD:
        importlib.import_module(name)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the zygote must not corrupt the answers
    children: set[int] = set()
    print(json.dumps({"ready": os.getpid()}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                answers.close()
                return request
            children.add(pid)
            answer: dict = {"pid": pid}
        elif request["op"] == "poll":
            answer = {"code": _poll(request["pid"], children)}
        else:
            break
        print(json.dumps(answer), file=answers, flush=True)
    for pid in children:
        _kill_group(pid)
    sys.exit(0)


def _poll(pid: int, children: set[int]) -> int | None:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        return None
    children.discard(pid)
    return os.waitstatus_to_exitcode(status)


def _run_job(job: dict) -> int:
    """In the forked child: become the rank torchrun would start, run the script, exit."""
    import runpy
    import traceback

    import torch

    os.setsid()  # a session of its own, as torchrun starts ranks: killing it reaches its children
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
    os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    argv = list(job["argv"])
    module = argv[1] if argv[0] == "-m" else None  # `python -m module args` as `python script args`
    sys.argv = argv[1:] if module else argv
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:1] = [os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0])), *extra]
    torch.set_num_threads(int(job["env"].get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    try:
        if module:
            sys.modules.pop(module, None)  # imported by the zygote; `-m` runs a fresh copy as __main__
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the client (the pytest process) -----------------------------------------------------------


class Zygote:
    """One zygote process (its rank index decides its PYTHONHASHSEED)."""

    def __init__(self, index: int):
        env = {
            **os.environ,
            "PYTHONHASHSEED": str(1009 * (index + 1) + os.getpid() % 1000),
            "PYTHONPATH": os.pathsep.join([REPO_ROOT, TESTS, os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=REPO_ROOT,
        )
        self.ready = False

    def ask(self, request: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.ready:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"rank zygote exited {self.proc.wait()} while importing {PRELOAD}")
            self.ready = True
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank zygote exited {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_ZYGOTES: list[Zygote] = []


def _zygotes(n: int) -> list[Zygote]:
    """The first `n` zygotes, started (all at once, importing in parallel) on first use."""
    if not _ZYGOTES:
        atexit.register(lambda: [z.close() for z in _ZYGOTES])
    while len(_ZYGOTES) < n:
        _ZYGOTES.append(Zygote(len(_ZYGOTES)))
    return _ZYGOTES[:n]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    """The variables torchrun --standalone gives rank `rank` of `nproc` on one node."""
    return {
        "OMP_NUM_THREADS": "1",
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": f"zygote-{port}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def launch(argv: list[str], nproc: int, env: dict, timeout_s: float, log_dir: str) -> tuple[list[int], str, str]:
    """Run `python <argv>` (a script, or `-m module`) on `nproc` forked ranks: (each rank's exit
    code, their stdout, their stderr, in rank order). As torchrun does, the first rank to fail
    stops the others. Past `timeout_s` every rank is killed and `subprocess.TimeoutExpired`
    raised. With nproc == 1 and no RANK in `env`, the one process is a plain `python` run."""
    port = _free_port()
    zygotes = _zygotes(nproc)
    logs = [(os.path.join(log_dir, f"rank{r}.out"), os.path.join(log_dir, f"rank{r}.err")) for r in range(nproc)]
    pids = []
    for rank, zygote in enumerate(zygotes):
        rank_vars = env if nproc == 1 else rank_env(env, rank, nproc, port)
        request = {"op": "spawn", "argv": argv, "env": rank_vars, "cwd": REPO_ROOT}
        pids.append(zygote.ask({**request, "stdout": logs[rank][0], "stderr": logs[rank][1]})["pid"])
    codes: list[int | None] = [None] * nproc
    deadline = time.monotonic() + timeout_s
    while None in codes:
        for rank, zygote in enumerate(zygotes):
            if codes[rank] is None:
                codes[rank] = zygote.ask({"op": "poll", "pid": pids[rank]})["code"]
        failed = any(c not in (None, 0) for c in codes)
        if failed or time.monotonic() > deadline:
            _stop(zygotes, pids, codes)
            if not failed:
                raise subprocess.TimeoutExpired(argv, timeout_s, _read(logs, 0), _read(logs, 1))
        time.sleep(0.02)
    return [c for c in codes if c is not None], _read(logs, 0), _read(logs, 1)


def _stop(zygotes: list[Zygote], pids: list[int], codes: list[int | None]) -> None:
    """Kill the ranks still running and reap them."""
    for rank, pid in enumerate(pids):
        if codes[rank] is None:
            _kill_group(pid)
    while None in codes:
        time.sleep(0.05)
        for rank, zygote in enumerate(zygotes):
            if codes[rank] is None:
                codes[rank] = zygote.ask({"op": "poll", "pid": pids[rank]})["code"]


def _read(logs: list[tuple[str, str]], which: int) -> str:
    parts = []
    for paths in logs:
        if os.path.exists(paths[which]):
            with open(paths[which]) as f:
                parts.append(f.read())
    return "".join(parts)


def _exit(code: int) -> None:
    """Exit as the interpreter does (join threads, atexit, flush) but skip tearing down every
    module: that costs seconds in a process that imported torch, and the OS frees it anyway."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(_run_job(_serve()))

"""Containment of worker processes that run user code (reward functions): whatever the code
starts, plain children, `setsid` children or double-forked daemons, dies with its worker, also
when the trainer is SIGKILLed.

Each worker is the child of a small *keeper* process (`keeper_main`) that runs no user code:

  trainer rank -> keeper (its own session) -> worker -> whatever the user's code starts

The keeper is a child subreaper (PR_SET_CHILD_SUBREAPER), so orphans of the worker's tree are
re-parented to it rather than to PID 1, and it puts the worker in a cgroup of its own where the
machine allows it. When the worker exits, the trainer asks (SIGTERM), or the rank dies (the
keeper's parent-death signal is SIGTERM), the keeper kills the whole tree and exits with the
worker's status. The strongest mechanism available is picked at run time:

  cgroup v2    the worker's own cgroup, killed as a whole (`cgroup.kill`, else freeze + kill every
               pid in it); `memory.max` and `pids.max` when those controllers are enabled there;
  cgroup v1    per controller (memory, pids, freezer) where v2 lacks it: memory.limit_in_bytes,
               pids.max, and freeze + kill when there is no v2 cgroup;
  subreaper    no usable cgroup: every descendant of the keeper is found in /proc and SIGKILLed,
               round after round until none is left. Weaker: a tree forking faster than the rounds
               kill can delay the end; no limit on the tree's memory or process count (the worker's
               own address space stays limited by RLIMIT_AS, `titanrl/components/worker_setup.py`).

TITANRL_NO_CGROUPS=1 in the environment selects the subreaper fallback (for tests, or a machine
whose cgroups misbehave). Not covered in any mode: a SIGKILL of the keeper itself (the worker
then dies by its parent-death signal, but what it started is left, in its cgroup where there is
one).
"""

import os
import signal
import subprocess
import sys
import time

from titanrl.components.console import get_logger

log = get_logger(__name__)

PIDS_MAX = 1024
"""Processes and threads a worker's cgroup may hold (a fork bomb stops there)."""
OOM_EXIT_CODE = 222
"""The keeper's exit code when the kernel killed the worker for crossing its cgroup memory limit."""
_V1_CONTROLLERS = ("memory", "pids", "freezer")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_KILL_ROUNDS = 200
JOINED: list[str] = []
"""The cgroup folders this process was put in by its keeper (set in the worker after the fork)."""


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _cgroup_dirs() -> dict[str, str]:
    """{'v2' | controller name: this process's cgroup folder} for each hierarchy mounted read-write."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _, path, fstype, options = line.split()[:4]
            opts = options.split(",")
            if "rw" not in opts:
                continue
            if fstype == "cgroup2":
                mounts["v2"] = path
            elif fstype == "cgroup":
                mounts.update({c: path for c in _V1_CONTROLLERS if c in opts})
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for key in ["v2"] if controllers == "" else controllers.split(","):
                if key in mounts:
                    found[key] = mounts[key] + path
    return found


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _try_write(path: str, value: str) -> None:
    try:
        _write(path, value)
    except OSError:
        pass


def create_cgroups(name: str) -> dict[str, str]:
    """Make cgroup `name` under this process's cgroup in each hierarchy that allows it: {key: folder}.
    v2 first; v1 memory / pids only where v2 lacks that controller, the v1 freezer only without v2."""
    made: dict[str, str] = {}
    if os.environ.get("TITANRL_NO_CGROUPS") == "1":  # the subreaper fallback, on purpose
        return made
    try:
        parents = _cgroup_dirs()
    except OSError:
        return made
    if "v2" in parents:  # the root cgroup, or a delegated one without processes, may enable them
        _try_write(os.path.join(parents["v2"], "cgroup.subtree_control"), "+memory +pids")
    for key in [k for k in ("v2", *_V1_CONTROLLERS) if k in parents]:
        covered = _v2_controllers(made.get("v2")) | ({"freezer"} if "v2" in made else set())
        if key in covered:
            continue
        folder = os.path.join(parents[key], name)
        try:
            os.mkdir(folder)
            if key == "v2" or key == "pids":
                _limit_pids(folder)
            made[key] = folder
        except OSError:
            _rmdir(folder)
    return made


def _v2_controllers(folder: str | None) -> set[str]:
    if folder is None:
        return set()
    with open(os.path.join(folder, "cgroup.controllers")) as f:
        controllers = set(f.read().split())
    return {c for c in controllers if os.path.exists(os.path.join(folder, f"{c}.max"))}


def _limit_pids(folder: str) -> None:
    if os.path.exists(os.path.join(folder, "pids.max")):
        _write(os.path.join(folder, "pids.max"), str(PIDS_MAX))


def describe(cgroups: dict[str, str]) -> str:
    """One line: how a worker given `cgroups` is contained."""
    if not cgroups:
        return "subreaper (no writable cgroup: descendants are found in /proc and killed; no tree-wide limits)"
    kill = "cgroup v2, killed with cgroup.kill" if "v2" in cgroups else "cgroup v1, frozen and killed"
    if "v2" in cgroups and not os.path.exists(os.path.join(cgroups["v2"], "cgroup.kill")):
        kill = "cgroup v2, frozen and killed"
    limits = [f"{c} (v1)" for c in ("memory", "pids") if c in cgroups]
    limits += [f"{c} (v2)" for c in sorted(_v2_controllers(cgroups.get("v2")) & {"memory", "pids"})]
    return f"{kill}; tree-wide limits: {', '.join(limits) or 'none'}"


_DESCRIPTION: str | None = None


def probe() -> str:
    """How workers started from this process will be contained (a cgroup made and removed once)."""
    global _DESCRIPTION
    if _DESCRIPTION is None:
        cgroups = create_cgroups(f"titanrl-probe-{os.getpid()}")
        _DESCRIPTION = describe(cgroups)
        remove_cgroups(cgroups)
    return _DESCRIPTION


_ANNOUNCED: set[str] = set()


def announce(kind: str) -> None:
    """Say once per process and kind ('reward', 'environment') how its workers are contained."""
    if kind not in _ANNOUNCED:
        _ANNOUNCED.add(kind)
        log.info(f"{kind} workers contained by {probe()}")


def join_cgroups(cgroups: dict[str, str]) -> None:
    """Move this process into `cgroups` (before it runs user code: what it starts is then inside)."""
    joined = []
    for folder in cgroups.values():
        try:
            _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))
            joined.append(folder)
        except OSError:  # e.g. a v1 hierarchy that refuses it: the others and the subreaper still hold
            pass
    JOINED[:] = joined


def set_memory_limit(limit_bytes: int) -> None:
    """Limit the memory of this worker's whole cgroup (itself and everything it starts), if it has one."""
    for folder in JOINED:
        for name in ("memory.max", "memory.limit_in_bytes"):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                _write(path, str(limit_bytes))


def oom_killed(cgroups: dict[str, str]) -> bool:
    """Did the kernel kill a process of these cgroups for crossing their memory limit?"""
    for folder in cgroups.values():
        for name in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(folder, name)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
            except OSError:
                continue
            if int(counts.get("oom_kill", 0)) > 0:
                return True
    return False


def _cgroup_pids(folder: str) -> list[int]:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def kill_cgroups(cgroups: dict[str, str]) -> None:
    """SIGKILL every process in `cgroups`: cgroup.kill where the kernel has it, else frozen first,
    so that nothing forks between reading cgroup.procs and the kill."""
    v2 = cgroups.get("v2")
    if v2 and os.path.exists(os.path.join(v2, "cgroup.kill")):
        _write(os.path.join(v2, "cgroup.kill"), "1")
        return
    freeze = (os.path.join(v2, "cgroup.freeze"), "1", "0") if v2 else None
    if "freezer" in cgroups:
        freeze = (os.path.join(cgroups["freezer"], "freezer.state"), "FROZEN", "THAWED")
    if freeze and os.path.exists(freeze[0]):
        _write(freeze[0], freeze[1])
    for folder in cgroups.values():
        for pid in _cgroup_pids(folder):
            _signal(pid, signal.SIGKILL)
    if freeze and os.path.exists(freeze[0]):
        _write(freeze[0], freeze[2])  # a killed process must run to die


def remove_cgroups(cgroups: dict[str, str]) -> None:
    for folder in cgroups.values():
        _rmdir(folder)


def _rmdir(folder: str) -> None:
    for _ in range(50):  # a killed process leaves its cgroup a moment after it was reaped
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[int]:
    """Live (not zombie) processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below `pid`, round after round, until none is left."""
    for _ in range(_KILL_ROUNDS):
        found = descendants(pid)
        if not found:
            return
        for child in found:
            _signal(child, signal.SIGKILL)
        time.sleep(0.005)


# ---- the keeper ----


def spawn_contained(target: str, fds: tuple[int, ...], output: int | None, root: str) -> subprocess.Popen:
    """Start a keeper that runs `target` ('module:function', called with `fds`) in a contained
    worker; stdout and stderr of both go to `output` (None: this process's). The keeper leads its
    own session: the trainer's terminal and process-group signals are not the worker's."""
    code = (
        f"import sys; sys.path.insert(0, {root!r}); from titanrl.components.containment import keeper_main; "
        f"keeper_main({os.getpid()}, {target!r}, {tuple(fds)!r})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        pass_fds=fds,
        start_new_session=True,
    )


def stop_contained(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """Have the keeper kill its worker and everything in it; reap the keeper; its exit status."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # a wedged keeper: its group at least (worker and plain children)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        return proc.wait()


def keeper_main(parent: int, target: str, fds: tuple[int, ...]) -> None:
    """The keeper: start the worker in its cgroups, wait for it (reaping the orphans re-parented
    here), then kill and reap everything left and exit with the worker's status."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the handler can kill a worker
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # the rank's death: the tree must go, not only the keeper
    if os.getppid() != parent:  # the rank died before the signal was set
        os._exit(0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    cgroups = create_cgroups(f"titanrl-worker-{os.getpid()}")
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        _run_worker(keeper, cgroups, target, fds)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGTERM, lambda *_: _kill_tree(keeper, cgroups))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == worker:
            break
    _kill_tree(keeper, cgroups)
    _reap_all(keeper, cgroups)
    oom = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and oom_killed(cgroups)
    remove_cgroups(cgroups)
    _exit_like(OOM_EXIT_CODE if oom else status, plain_code=oom)


def _run_worker(keeper: int, cgroups: dict[str, str], target: str, fds: tuple[int, ...]) -> None:
    """The forked worker: into its cgroups, then the target; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != keeper:
            os._exit(0)
        join_cgroups(cgroups)
        import importlib

        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*fds)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, on stderr
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - the user's code may have closed it
                pass
        os._exit(code)


def _kill_tree(keeper: int, cgroups: dict[str, str]) -> None:
    try:
        kill_cgroups(cgroups)
    except OSError:  # the cgroup went away or refused: the descendants' walk below still kills
        pass
    kill_descendants(keeper)


def _reap_all(keeper: int, cgroups: dict[str, str], timeout_s: float = 10.0) -> None:
    """Reap every child (orphans of the worker's tree came here), killing again what is left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            _kill_tree(keeper, cgroups)
            time.sleep(0.01)


def _exit_like(status: int, plain_code: bool = False) -> None:
    """Exit as the worker did: the same code, or killed by the same signal."""
    if plain_code:
        os._exit(status)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker's crash, not the keeper's core
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        time.sleep(1.0)  # the signal is delivered meanwhile
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)

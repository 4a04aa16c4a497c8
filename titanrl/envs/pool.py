"""Environment episodes in worker processes: asynchronous reset / step with a timeout.

Each episode lives in one worker (its state is there); calls are sent without waiting and their
results collected by `poll`, so the generator keeps decoding other samples meanwhile. Workers are
contained as reward workers are (`titanrl/components/containment.py`): each is the child of a
keeper that kills everything the environment's code started, `setsid` children and daemons
included, when the worker ends, is replaced, or the trainer dies; a per-worker address-space
limit (`titanrl/components/worker_setup.py: init_worker`) and, with a cgroup, a memory limit on its
whole tree. A call that raises, returns garbage or runs past the timeout fails *its episode*
(recorded, never raised); a hung or dead worker is killed and replaced, failing the episodes it
held. A worker that raised MemoryError is retired: its episode fails ('memory: ...'), new
episodes go to a fresh worker, and the episodes it still holds finish on it before it is stopped.
"""

import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from titanrl.components.containment import OOM_EXIT_CODE, announce, spawn_contained, stop_contained
from titanrl.components.plugins import load_object
from titanrl.components.worker_setup import init_worker
from titanrl.envs.base import StepResult
from titanrl.envs.builtin import ENVS

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OVER_MEMORY = "memory: the worker crossed its memory limit (reward.memory_limit_mb) and was killed"


def resolve_env(spec: str) -> type:
    """A built-in env name or 'module:Class' (a module failing at import is one line naming its
    file:line, as for reward functions)."""
    if spec in ENVS:
        return ENVS[spec]
    if ":" not in spec:
        raise ValueError(f"env.name '{spec}' is neither a built-in env ({', '.join(ENVS)}) nor a 'module:Class'")
    return load_object(spec, "env.name")


def _call(envs: dict[int, Any], cls: type, kwargs: dict, op: str, eid: int, payload: Any) -> tuple | None:
    """Run one request on the worker's episodes: (eid, kind, value) to send back, or None."""
    try:
        if op == "reset":
            envs[eid] = cls(**kwargs)
            return eid, "ok", envs[eid].reset(payload)
        if op == "step":
            return eid, "ok", envs[eid].step(payload)
        envs.pop(eid, None)  # "close"
        return None
    except MemoryError as e:  # what the code holds may fail every later call: the worker is retired
        envs.pop(eid, None)
        return eid, "memory", f"MemoryError: {e}"
    except BaseException as e:  # noqa: BLE001 - any failure of user code ends only its episode
        envs.pop(eid, None)
        return eid, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"[:2000]


def env_worker_main(fd: int) -> None:
    """The environment worker (run by its keeper): requests and results on the socket `fd`."""
    conn = Connection(fd)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    cls = resolve_env(init["spec"])
    init_worker(init["memory_limit_mb"])  # after the import: the limit is what the env may allocate
    me = os.getpid()
    envs: dict[int, Any] = {}
    while True:
        try:
            op, eid, payload = conn.recv()
        except EOFError:
            return
        reply = _call(envs, cls, init["kwargs"], op, eid, payload)
        if os.getpid() != me:  # a process the env's code forked came back here: it must not answer
            os._exit(0)
        if reply is not None:
            conn.send(reply)


class _Worker:
    """The trainer's handle on one environment worker: its keeper and its end of the socket."""

    def __init__(self, init: dict) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = spawn_contained("titanrl.envs.pool:env_worker_main", (child.fileno(),), None, _ROOT)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.conn.send(init)

    def stop(self) -> int:
        """Kill it and everything it started; its exit status (OOM_EXIT_CODE: killed for memory)."""
        self.conn.close()
        return stop_contained(self.proc)


@dataclass
class EnvResult:
    episode: int
    op: str
    value: str | StepResult | None
    """reset: the first observation; step: a validated StepResult; None if failed."""
    error: str | None = None
    """'error: ...', 'memory: ...', 'timeout', 'invalid: ...', 'worker died' or 'worker restarted'
    when the call failed."""


def validate_step(out: Any) -> StepResult:
    """(observation, reward, done, info) from a user env, checked; ValueError says what is wrong."""
    if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
        raise ValueError(f"step() must return (observation, reward, done[, info]), got {type(out).__name__}")
    obs, reward, done = out[:3]
    info = out[3] if len(out) == 4 else {}
    if not isinstance(obs, str):
        raise ValueError(f"observation must be a str, got {type(obs).__name__}")
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or reward != reward
        or abs(reward) == float("inf")
    ):
        raise ValueError(f"reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise ValueError(f"done must be a bool, got {done!r}")
    return StepResult(obs, float(reward), done, info if isinstance(info, dict) else {})


class EnvPool:
    def __init__(
        self,
        spec: str,
        kwargs: dict | None = None,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_limit_mb: int = 2048,
    ) -> None:
        resolve_env(spec)  # a bad name fails here, in the trainer, with a clear message
        self.timeout_s = timeout_s
        self._init = {
            "spec": spec,
            "kwargs": kwargs or {},
            "memory_limit_mb": memory_limit_mb,
            "sys_path": list(sys.path),
        }
        announce("environment")
        self._workers: list[_Worker] = [_Worker(self._init) for _ in range(num_workers)]
        self._retiring: list[_Worker] = []  # raised MemoryError: they finish the episodes they hold
        self._home: dict[int, _Worker] = {}  # episode -> its worker
        self._pending: dict[int, tuple[str, float]] = {}  # episode -> (op, deadline)
        self._ready: list[EnvResult] = []
        self.restarts = 0

    def _send(self, episode: int, op: str, payload: Any) -> None:
        if op == "reset":
            self._home[episode] = self._workers[episode % len(self._workers)]
        home = self._home.get(episode)
        if home is None:  # its worker was replaced: the state is gone
            self._ready.append(EnvResult(episode, op, None, "worker died"))
            return
        try:
            home.conn.send((op, episode, payload))
        except (BrokenPipeError, OSError):
            self._restart(home, "worker died")
            self._ready.append(EnvResult(episode, op, None, "worker died"))
            return
        self._pending[episode] = (op, time.monotonic() + self.timeout_s)

    def reset(self, episode: int, sample: dict) -> None:
        self._send(episode, "reset", sample)

    def step(self, episode: int, text: str) -> None:
        self._send(episode, "step", text)

    def episode_tools(self, episode: int) -> list[dict] | None:
        """Tools the episode declared itself (none here: the environment class's `tools` serve)."""
        return None

    def close_episode(self, episode: int) -> None:
        home = self._home.pop(episode, None)
        if home is not None:
            try:
                home.conn.send(("close", episode, None))
            except (BrokenPipeError, OSError):
                pass
        self._stop_idle_retired()

    def _restart(self, w: _Worker, reason: str, culprit: int | None = None) -> None:
        """Replace worker `w`; its pending calls fail (`reason` for `culprit`, else 'worker
        restarted'; the worker's own memory-limit kill for all) and its other episodes lose their state."""
        if w.stop() == OOM_EXIT_CODE:
            reason, culprit = _OVER_MEMORY, None
        self.restarts += 1
        for episode, home in list(self._home.items()):
            if home is w:
                del self._home[episode]
                if episode in self._pending:
                    op, _ = self._pending.pop(episode)
                    why = reason if culprit is None or episode == culprit else "worker restarted"
                    self._ready.append(EnvResult(episode, op, None, why))
        if w in self._retiring:
            self._retiring.remove(w)
        else:
            self._workers[self._workers.index(w)] = _Worker(self._init)

    def _retire(self, w: _Worker) -> None:
        """A fresh worker takes `w`'s slot; `w` serves the episodes it holds until they end."""
        if w in self._workers:
            self._workers[self._workers.index(w)] = _Worker(self._init)
            self._retiring.append(w)
            self.restarts += 1

    def _stop_idle_retired(self) -> None:
        for w in [w for w in self._retiring if w not in self._home.values()]:
            self._retiring.remove(w)
            w.stop()

    def poll(self, block: bool) -> list[EnvResult]:
        """Results of finished calls; with `block`, wait until at least one (or a timeout)."""
        while True:
            conns = {w.conn: w for w in self._workers + self._retiring}
            wait_s = 0.0
            if block and not self._ready and self._pending:
                wait_s = max(0.0, min(d for _, d in self._pending.values()) - time.monotonic())
            for conn in wait(list(conns), timeout=wait_s):
                assert isinstance(conn, Connection), "wait() returns the ready objects it was given"
                try:
                    while True:  # drain: several episodes' results may be queued on one worker
                        self._receive(conns[conn], *conn.recv())
                        if not conn.poll():
                            break
                except (EOFError, OSError):
                    self._restart(conns[conn], "worker died")
            now = time.monotonic()
            for episode, (_op, deadline) in list(self._pending.items()):
                if now >= deadline and episode in self._pending:
                    # A call past its deadline: its worker is stuck; replace it.
                    self._restart(self._home[episode], "timeout", culprit=episode)
            self._stop_idle_retired()
            if self._ready or not block or not self._pending:
                out, self._ready = self._ready, []
                return out

    def _receive(self, w: _Worker, episode: int, kind: str, value: Any) -> None:
        """A worker's answer to a call: checked and queued as that episode's result."""
        if episode not in self._pending:
            return
        op, _ = self._pending.pop(episode)
        if kind != "ok":  # the worker dropped the episode's state
            self._home.pop(episode, None)
            if kind == "memory":
                self._retire(w)
            self._ready.append(EnvResult(episode, op, None, f"{kind}: " + value.splitlines()[0]))
            return
        if op == "step":
            try:
                value = validate_step(value)
            except ValueError as e:
                self._ready.append(EnvResult(episode, op, None, f"invalid: {e}"))
                return
        elif not isinstance(value, str) or not value:
            self._ready.append(EnvResult(episode, op, None, "invalid: reset() must return a non-empty str"))
            return
        self._ready.append(EnvResult(episode, op, value))

    def close(self) -> None:
        """Kill every worker and whatever its environment started."""
        for w in self._workers + self._retiring:
            w.stop()
        self._workers, self._retiring = [], []

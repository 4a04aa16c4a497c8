"""Environment episodes in worker processes: asynchronous reset / step with a timeout.

Each episode lives in one worker (its state is there); calls are sent without waiting and their
results collected by `poll`, so the generator keeps decoding other samples meanwhile. Isolation
is the reward runner's (`titanrl/components/workers.py: init_worker`): a per-worker address-space limit,
death with the trainer. A call that raises, returns garbage or runs past the timeout fails
*its episode* (recorded, never raised); a hung or dead worker is killed and replaced, failing
the episodes it held.
"""

import importlib
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from titanrl.components.workers import init_worker
from titanrl.envs.base import StepResult
from titanrl.envs.builtin import ENVS


def resolve_env(spec: str) -> type:
    """A built-in env name or 'module:Class'."""
    if spec in ENVS:
        return ENVS[spec]
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"env.name '{spec}' is neither a built-in env ({', '.join(ENVS)}) nor an importable 'module:Class' ({e})"
        ) from None


def _worker_main(conn: Connection, spec: str, kwargs: dict, memory_limit_mb: int) -> None:
    init_worker(memory_limit_mb)
    cls = resolve_env(spec)
    envs: dict[int, Any] = {}
    while True:
        try:
            op, eid, payload = conn.recv()
        except EOFError:
            return
        try:
            if op == "reset":
                envs[eid] = cls(**kwargs)
                result = envs[eid].reset(payload)
            elif op == "step":
                result = envs[eid].step(payload)
            else:  # "close"
                envs.pop(eid, None)
                continue
            conn.send((eid, True, result))
        except BaseException as e:  # noqa: BLE001 - any failure of user code ends only its episode
            envs.pop(eid, None)
            conn.send((eid, False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"[:2000]))


@dataclass
class EnvResult:
    episode: int
    op: str
    value: str | StepResult | None
    """reset: the first observation; step: a validated StepResult; None if failed."""
    error: str | None = None
    """'error: ...', 'timeout', 'invalid: ...' or 'worker died' when the call failed."""


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
        self.spec, self.kwargs = spec, kwargs or {}
        self.timeout_s, self.memory_limit_mb = timeout_s, memory_limit_mb
        self._ctx = mp.get_context("spawn")
        self._workers: list[tuple[mp.Process, Connection] | None] = [None] * num_workers
        self._home: dict[int, int] = {}  # episode -> worker index
        self._pending: dict[int, tuple[str, float]] = {}  # episode -> (op, deadline)
        self._ready: list[EnvResult] = []
        self.restarts = 0
        for i in range(num_workers):
            self._start(i)

    def _start(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.spec, self.kwargs, self.memory_limit_mb), daemon=True
        )
        proc.start()
        child.close()
        self._workers[i] = (proc, parent)

    def _send(self, episode: int, op: str, payload: Any) -> None:
        if op == "reset":
            self._home[episode] = episode % len(self._workers)
        home = self._home.get(episode)
        if home is None:  # its worker was replaced: the state is gone
            self._ready.append(EnvResult(episode, op, None, "worker died"))
            return
        try:
            self._workers[home][1].send((op, episode, payload))
        except (BrokenPipeError, OSError):
            self._restart(home, "worker died")
            self._ready.append(EnvResult(episode, op, None, "worker died"))
            return
        self._pending[episode] = (op, time.monotonic() + self.timeout_s)

    def reset(self, episode: int, sample: dict) -> None:
        self._send(episode, "reset", sample)

    def step(self, episode: int, text: str) -> None:
        self._send(episode, "step", text)

    def close_episode(self, episode: int) -> None:
        home = self._home.pop(episode, None)
        if home is not None:
            try:
                self._workers[home][1].send(("close", episode, None))
            except (BrokenPipeError, OSError):
                pass

    def _restart(self, i: int, reason: str, culprit: int | None = None) -> None:
        """Replace worker i; its pending calls fail (`reason` for `culprit`, else 'worker
        restarted') and its other episodes lose their state."""
        proc, conn = self._workers[i]
        proc.kill()
        proc.join(timeout=5)
        conn.close()
        self.restarts += 1
        for episode, home in list(self._home.items()):
            if home == i:
                del self._home[episode]
                if episode in self._pending:
                    op, _ = self._pending.pop(episode)
                    why = reason if culprit is None or episode == culprit else "worker restarted"
                    self._ready.append(EnvResult(episode, op, None, why))
        self._start(i)

    def poll(self, block: bool) -> list[EnvResult]:
        """Results of finished calls; with `block`, wait until at least one (or a timeout)."""
        while True:
            conns = {self._workers[i][1]: i for i in range(len(self._workers))}
            now = time.monotonic()
            wait_s = 0.0
            if block and not self._ready and self._pending:
                wait_s = max(0.0, min(d for _, d in self._pending.values()) - now)
            messages = []
            for conn in wait(list(conns), timeout=wait_s):
                try:
                    while True:  # drain: several episodes' results may be queued on one worker
                        messages.append(conn.recv())
                        if not conn.poll():
                            break
                except (EOFError, OSError):
                    self._restart(conns[conn], "worker died")
            for episode, ok, value in messages:
                if episode not in self._pending:
                    continue
                op, _ = self._pending.pop(episode)
                if not ok:
                    self._ready.append(EnvResult(episode, op, None, "error: " + value.splitlines()[0]))
                    continue
                if op == "step":
                    try:
                        value = validate_step(value)
                    except ValueError as e:
                        self._ready.append(EnvResult(episode, op, None, f"invalid: {e}"))
                        continue
                elif not isinstance(value, str) or not value:
                    self._ready.append(EnvResult(episode, op, None, "invalid: reset() must return a non-empty str"))
                    continue
                self._ready.append(EnvResult(episode, op, value))
            now = time.monotonic()
            for episode, (_op, deadline) in list(self._pending.items()):
                if now >= deadline and episode in self._pending:
                    # A call past its deadline: its worker is stuck; replace it.
                    self._restart(self._home[episode], "timeout", culprit=episode)
            if self._ready or not block or not self._pending:
                out, self._ready = self._ready, []
                return out

    def close(self) -> None:
        for entry in self._workers:
            if entry is not None:
                proc, conn = entry
                conn.close()
                proc.kill()
                proc.join(timeout=5)

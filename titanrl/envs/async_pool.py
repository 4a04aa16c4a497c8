"""The trainer's side of an environment pool whose episodes run as coroutines on one background
event-loop thread (`ServerEnvPool`, `VerifiersEnvPool`), with `EnvPool`'s interface: calls are
submitted without waiting, and `poll` collects the `EnvResult`s the loop puts on a queue, so
many episodes are in flight while the generator decodes."""

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from typing import Any

from titanrl.envs.pool import EnvResult

_DRAIN_S = 5.0
"""How long closing a pool waits for its loop's remaining tasks once cancelled."""


class AsyncEnvPool(ABC):
    """Subclasses define the coroutines `_reset(episode, sample)`, `_step(episode, text)`,
    `_close(episode)` and `_close_all()`, each putting its result on `self._results`, and
    `poll_backstop_s`: the longest `poll(block=True)` may wait (every call has its own deadline,
    which answers well before)."""

    poll_backstop_s: float = 60.0

    def __init__(self, thread_name: str) -> None:
        self._results: queue.SimpleQueue[EnvResult] = queue.SimpleQueue()
        self._in_flight = 0  # calls submitted and not yet polled (the trainer's thread only)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()

    @abstractmethod
    async def _reset(self, episode: int, sample: dict) -> None: ...

    @abstractmethod
    async def _step(self, episode: int, text: str) -> None: ...

    @abstractmethod
    async def _close(self, episode: int) -> None: ...

    @abstractmethod
    async def _close_all(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """End every episode and stop the loop thread (`_stop_loop`), and what the pool started."""

    def _submit(self, coro: Any) -> None:
        self._in_flight += 1
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def reset(self, episode: int, sample: dict) -> None:
        self._submit(self._reset(episode, sample))

    def step(self, episode: int, text: str) -> None:
        self._submit(self._step(episode, text))

    def episode_tools(self, episode: int) -> list[dict] | None:
        """Tools the episode declared itself (a verifiers harness's request); None: the environment's."""
        return None

    def close_episode(self, episode: int) -> None:
        asyncio.run_coroutine_threadsafe(self._close(episode), self._loop)

    def poll(self, block: bool) -> list[EnvResult]:
        """Results of finished calls; with `block`, wait until at least one."""
        out: list[EnvResult] = []
        if block and self._in_flight:
            out.append(self._results.get(timeout=self.poll_backstop_s))
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def _stop_loop(self, close_timeout_s: float) -> None:
        """End every episode (`_close_all`), then stop the loop thread."""
        if not self._thread.is_alive():
            return
        for coro, timeout_s in ((self._close_all(), close_timeout_s), (self._drain(), _DRAIN_S + 1.0)):
            done = asyncio.run_coroutine_threadsafe(coro, self._loop)
            try:
                done.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._loop.close()

    @staticmethod
    async def _drain() -> None:
        """Cancel the tasks still running (a library's shielded clean-ups among them) and wait for
        them, as `asyncio.run` does at its end: none is left to be finalized after the loop stops."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_DRAIN_S)
        await asyncio.get_running_loop().shutdown_asyncgens()

"""Run reward functions in worker processes, with a timeout, isolated from the training process.

A reward function that raises, hangs past the timeout, kills its worker or returns a non-finite
or non-numeric value gives the configured failure reward for that sample and is counted; the
step goes on. A hung or dead worker pool is replaced.
"""

import math
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable

from titanrl.components.workers import init_worker
from titanrl.envs.tasks import Task


@dataclass
class RewardItem:
    prompt: str
    completion: str
    answer: str
    metadata: dict = field(default_factory=dict)


@dataclass
class RewardResult:
    reward: float
    correct: bool
    failed: str | None = None
    """None, or 'error' / 'timeout' / 'invalid' for a sample whose reward function failed."""
    turn_rewards: list[float] | None = None
    """Multi-turn episodes: the reward of each environment step (`reward` is their sum)."""


def _warm_up(fn: object) -> None:
    del fn


def _call(fn: Task | Callable[..., Any], item: RewardItem) -> tuple[float, bool]:
    if isinstance(fn, Task):
        score = fn.score(item.completion, item.answer, item.metadata)
        return score.reward, score.correct
    out = fn(item.prompt, item.completion, item.metadata)
    if isinstance(out, dict):
        return out["reward"], bool(out.get("correct", False))
    return out, False


class RewardRunner:
    def __init__(
        self, fn: Task | Callable[..., Any], num_workers: int, timeout_s: float, failure_reward: float,
        memory_limit_mb: int = 0,
    ) -> None:
        self.fn = fn
        self.memory_limit_mb = memory_limit_mb
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: workers never inherit the trainer's threads or process groups. `self.fn` is
        # passed to the initializer so that its module is imported before the memory limit is set.
        pool = ProcessPoolExecutor(
            self.num_workers, mp_context=mp.get_context("spawn"), initializer=init_worker,
            initargs=(self.memory_limit_mb, self.fn),
        )
        # Start every worker now, so that start-up time is never charged to a sample's timeout.
        for fut in [pool.submit(_warm_up, self.fn) for _ in range(self.num_workers)]:
            fut.result()
        return pool

    def _kill_pool(self) -> None:
        if self._pool is None:
            return
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def __call__(self, items: list[RewardItem]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(items)
        pending = list(range(len(items)))
        while pending:
            if self._pool is None:
                self._pool = self._new_pool()
            futures = {i: self._pool.submit(_call, self.fn, items[i]) for i in pending}
            pending = []
            restart = False
            for i, fut in futures.items():
                if restart:  # the pool is being replaced; resubmit what did not finish
                    if fut.done() and not fut.cancelled() and fut.exception() is None:
                        results[i] = self._check(fut.result())
                    else:
                        pending.append(i)
                    continue
                try:
                    results[i] = self._check(fut.result(timeout=self.timeout_s))
                except FutureTimeout:
                    results[i] = RewardResult(self.failure_reward, False, "timeout")
                    restart = True
                except BrokenProcessPool:
                    results[i] = RewardResult(self.failure_reward, False, "error")
                    restart = True
                except Exception:  # the reward function raised: isolate this sample only
                    results[i] = RewardResult(self.failure_reward, False, "error")
            if restart:
                self._kill_pool()
        return results  # type: ignore[return-value]

    def _check(self, out: tuple[Any, bool]) -> RewardResult:
        reward, correct = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return RewardResult(self.failure_reward, False, "invalid")
        return RewardResult(float(reward), correct)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

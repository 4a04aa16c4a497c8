"""Run reward functions in worker processes, isolated from the training process, under a deadline
per batch.

Whatever the reward function does to one sample gives that sample the configured failure reward
and a counted reason (`RewardResult.failed`); the other samples of the batch are scored and the
step goes on:
  'error'   it raised, SystemExit, KeyboardInterrupt and GeneratorExit included (the worker lives on);
  'memory'  MemoryError past reward.memory_limit_mb, or its worker's tree crossed that limit (cgroup);
            the worker is replaced either way, so memory it leaked fails no later sample;
  'invalid' it returned something that is not a finite number;
  'crash'   its worker died (os._exit, a segfault, a signal, killed for memory);
  'timeout' it was unfinished, running or still queued, when the batch's deadline passed.

Workers (`titanrl/rewards/worker.py`) are plain interpreters that import only the reward
function's module, each contained (`titanrl/components/containment.py`), so that what the
function starts dies with its worker, even when the trainer is SIGKILLed. A hung worker is
killed at the deadline; a dead one is replaced at once, unless the same slot's workers die twice
in a row within a batch (a function that kills every worker): that slot then rests until the
batch ends, and once every slot rests the samples left fail as 'crash' at once. Replacements for
a batch's casualties start as it ends, so they warm up while the trainer trains. Each sample's
stdout and stderr are captured (first OUTPUT_KEEP_BYTES kept). The worker slots, their start-up
and their events are `worker_pool.py`'s; what they mean for a batch's samples, this module's.
"""

import os
import pickle
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titanrl.components.containment import announce
from titanrl.data.tasks import Task
from titanrl.rewards.worker import OUTPUT_KEEP_BYTES, RewardWorker
from titanrl.rewards.worker_pool import RewardWorkerPool

__all__ = [
    "FAILURE_REASONS",
    "OUTPUT_KEEP_BYTES",
    "RewardItem",
    "RewardOutputLog",
    "RewardResult",
    "RewardRunner",
    "RewardStats",
]

FAILURE_REASONS = ("error", "memory", "invalid", "crash", "timeout", "unknown_model", "rewrite")
"""The values of `RewardResult.failed` when a reward function failed."""

_MAX_DEATHS_IN_A_ROW = 2  # a slot whose workers die this often in a row rests for the batch


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
    """None, or why the sample got the failure reward: one of FAILURE_REASONS (see this module's
    docstring); for multi-turn episodes, the environment's reason."""
    turn_rewards: list[float] | None = None
    """Multi-turn episodes: the reward of each environment step (`reward` is their sum)."""
    output: str = ""
    """What the call wrote to stdout and stderr, its first OUTPUT_KEEP_BYTES bytes."""
    output_dropped: int = 0
    """Bytes of output beyond those kept."""
    detail: str = ""
    """A failure's particulars: the exception and its traceback tail, or how the worker died."""


@dataclass
class _Batch:
    """The batch being scored: items in submission order, their results, the queue of items not
    yet given to a worker, and each worker slot's deaths in a row."""

    deaths: list[int]
    items: list[RewardItem] = field(default_factory=list)
    results: list[RewardResult | None] = field(default_factory=list)
    queue: deque = field(default_factory=deque)
    done: int = 0


class RewardRunner:
    def __init__(
        self,
        fn: Task | Callable[..., Any],
        num_workers: int,
        timeout_s: float,
        failure_reward: float,
        memory_limit_mb: int = 0,
    ) -> None:
        self.fn = fn
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self.memory_limit_mb = memory_limit_mb
        self._mode = "task" if isinstance(fn, Task) else "fn"
        try:
            blob = pickle.dumps(fn)
        except Exception as e:
            raise ValueError(
                f"the reward function must be picklable (a module-level function or a Task): {e}"
            ) from None
        init = {"fn": blob, "sys_path": list(sys.path), "main": _main_module(blob), "memory_limit_mb": memory_limit_mb}
        self.pool = RewardWorkerPool(num_workers, init)
        self._batch: _Batch | None = None
        announce("reward")
        self.pool.start_missing()  # they warm up while the trainer builds its model

    def __call__(self, items: list[RewardItem]) -> list[RewardResult]:
        if not items:
            return []
        try:
            self.begin()
            self.submit(items)
            return self.finish()
        finally:
            if self.pool.loaded:
                self.pool.start_missing()

    # ---- a batch, streamed: begin, submit as samples finish, finish ----

    def begin(self) -> None:
        """Start a batch whose items come in several `submit` calls (e.g. as the generator
        finishes samples, so that scoring overlaps decoding); `finish` returns its results. The
        first batch waits for the workers to load the function (a module that cannot load is a
        clear error at once); later ones start the workers lost meanwhile and go on while they
        load (they take work once ready)."""
        if self.pool.loaded:
            self.pool.replace_lost()
        else:
            self.pool.warm_up()
        self._batch = _Batch(deaths=[0] * self.num_workers)

    def submit(self, items: list[RewardItem]) -> None:
        """Queue `items` (results in submission order) and hand work to idle workers; never waits."""
        b = self._batch
        assert b is not None, "submit() outside begin() / finish()"
        for item in items:
            b.queue.append(len(b.items))
            b.items.append(item)
            b.results.append(None)
        self._advance(0.0)

    def poll(self) -> None:
        """Read what the workers sent and hand them queued work; never waits."""
        if self._batch is not None:
            self._advance(0.0)

    def finish(self) -> list[RewardResult]:
        """Results of every submitted item, waiting up to reward.timeout_s from now."""
        b = self._batch
        assert b is not None, "finish() without begin()"
        deadline = time.monotonic() + self.timeout_s  # counted from here: every worker is warm
        while b.done < len(b.items):
            left = deadline - time.monotonic()
            if left <= 0 or not self._advance(left):
                break
        # The deadline: unfinished samples time out; only the workers busy with them are killed.
        for slot, w in enumerate(self.pool.slots):
            if w is not None and w.sample is not None:
                w.read_output()
                b.results[w.sample] = self._result(
                    w, "timeout", 0.0, False, f"still running after the batch's {self.timeout_s:g} s"
                )
                w.kill()
                self.pool.slots[slot] = None
        for i in b.queue:
            b.results[i] = self._failure("timeout", f"not started within the batch's {self.timeout_s:g} s")
        self._batch = None
        if self.pool.loaded:  # replacements warm up while the trainer trains
            self.pool.start_missing()
        results = [r for r in b.results if r is not None]
        assert len(results) == len(b.items), "an item without a result after the deadline"
        return results

    def _advance(self, timeout: float) -> bool:
        """Dispatch queued items to idle workers, then handle what happens within `timeout` s.
        False when nothing could ever run the queued items (they fail as 'crash')."""
        b = self._batch
        assert b is not None, "a batch's work outside begin() / finish()"
        slots = self.pool.slots
        for w in slots:
            if w is not None and w.ready and w.sample is None and b.queue:
                self._dispatch(w, b.queue.popleft(), b.items)
        if b.queue and all(w is None for w in slots):  # every slot rests: nothing would run them
            for i in b.queue:
                b.results[i] = self._failure("crash", "not run: the reward workers kept dying this batch")
                b.done += 1
            b.queue.clear()
            return False
        for event, w, payload in self.pool.events(timeout):
            slot = slots.index(w)
            if event == "ready":
                w.ready = True
            elif event == "result" and payload[0] == w.sample:
                index, kind, reward, correct, detail = payload
                w.read_output()  # the rest of what the call wrote
                b.results[index] = self._result(w, kind, reward, correct, detail)
                w.sample, b.deaths[slot], b.done = None, 0, b.done + 1
                if kind == "memory":  # what it leaked would fail every later sample: a fresh worker
                    w.kill()
                    slots[slot] = self.pool.start()
            elif event == "dead":
                if w.sample is not None:
                    kind = "memory" if w.over_memory else "crash"
                    b.results[w.sample] = self._result(w, kind, 0.0, False, payload)
                    b.done += 1
                b.deaths[slot] += 1
                slots[slot] = self.pool.start() if b.deaths[slot] < _MAX_DEATHS_IN_A_ROW else None
        return True

    def _dispatch(self, w: RewardWorker, index: int, items: list[RewardItem]) -> None:
        w.read_output()
        w.take_output()  # what it wrote between calls is no sample's
        w.sample, item = index, items[index]
        w.send(
            (
                index,
                self._mode,
                (item.completion, item.answer, item.metadata)
                if self._mode == "task"
                else (item.prompt, item.completion, item.metadata),
            )
        )

    def _result(self, w: RewardWorker, kind: str, reward: float, correct: bool, detail: str) -> RewardResult:
        output, dropped = w.take_output()
        if kind == "ok":
            return RewardResult(reward, correct, output=output, output_dropped=dropped)
        return RewardResult(self.failure_reward, False, kind, output=output, output_dropped=dropped, detail=detail)

    def _failure(self, kind: str, detail: str) -> RewardResult:
        return RewardResult(self.failure_reward, False, kind, detail=detail)

    def close(self) -> None:
        """Kill every worker and whatever it forked; a later call starts new ones."""
        self.pool.close()


def _main_module(blob: bytes) -> dict:
    """How a worker imports the trainer's __main__, when the pickled function lives there."""
    if b"__main__" not in blob:
        return {}
    from multiprocessing import spawn

    data = spawn.get_preparation_data("reward-worker")
    return {k: data[k] for k in ("init_main_from_name", "init_main_from_path") if k in data}


@dataclass
class RewardStats:
    """A step's reward-function failures, in all and by reason, and the output bytes dropped:
    sums, a base of the recipe's `StepStats` (reduced over ranks with its other fields)."""

    reward_failures: float = 0.0
    reward_failures_error: float = 0.0
    reward_failures_memory: float = 0.0
    reward_failures_invalid: float = 0.0
    reward_failures_crash: float = 0.0
    reward_failures_timeout: float = 0.0
    reward_failures_unknown_model: float = 0.0
    reward_failures_rewrite: float = 0.0
    reward_output_dropped: float = 0.0

    def add_reward_results(self, results: list[RewardResult]) -> None:
        for r in results:
            reason = (r.failed or "").split(":")[0]  # an environment's reads 'error: <what>'
            if reason in FAILURE_REASONS:
                setattr(self, f"reward_failures_{reason}", getattr(self, f"reward_failures_{reason}") + 1)
            self.reward_failures += r.failed is not None
            self.reward_output_dropped += r.output_dropped

    def reward_metrics(self) -> dict[str, float]:
        """reward_failures and reward_output_dropped_bytes; reward_failures_<reason> where nonzero
        (most steps have no failures)."""
        by_reason = {f"reward_failures_{k}": getattr(self, f"reward_failures_{k}") for k in FAILURE_REASONS}
        return {
            "reward_failures": self.reward_failures,
            "reward_output_dropped_bytes": self.reward_output_dropped,
            **{k: v for k, v in by_reason.items() if v},
        }


class RewardOutputLog:
    """What reward functions printed, and why samples failed, appended to this rank's
    `<folder>/reward_output.log` (rank r > 0: reward_output.rank<r>.log), never to the console:
    per sample that printed or failed, a header ('=== step 3 sample 12: failed (error)'), its
    kept output (at most OUTPUT_KEEP_BYTES) and its failure detail."""

    def __init__(self, folder: str, rank: int) -> None:
        self.path = os.path.join(folder, "reward_output.log" if rank == 0 else f"reward_output.rank{rank}.log")
        self.step = 0

    def write(self, results: list[RewardResult], step: int | None = None) -> None:
        """Log a training step's results, or (no `step`) an evaluation's after the last step."""
        if step is not None:
            self.step = step
        text = self.format(f"step {step}" if step is not None else f"eval after step {self.step}", results)
        if text:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8", errors="replace") as f:
                f.write(text)

    @staticmethod
    def format(label: str, results: list[RewardResult]) -> str:
        parts = []
        for i, r in enumerate(results):
            if not (r.output or r.output_dropped or r.failed):
                continue
            outcome = f"failed ({r.failed})" if r.failed else f"reward {r.reward:g}"
            dropped = f", {r.output_dropped} bytes of output dropped" if r.output_dropped else ""
            parts.append(f"=== {label} sample {i}: {outcome}{dropped}\n")
            parts.extend(text if text.endswith("\n") else text + "\n" for text in (r.output, r.detail) if text)
        return "".join(parts)

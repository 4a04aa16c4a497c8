"""The reward worker processes of a `RewardRunner`: their slots, start-up, events and end.

Each slot holds a `RewardWorker` (`worker.py`) or None: lost (it died, or was killed at a
deadline) or resting for the batch (its workers kept dying). The pool starts workers, waits for
them to load the reward function, and turns what they send and how they die into events; which
sample a worker scores, and what its death means for that sample, is the runner's business.
"""

import selectors
import time
from typing import Any

from titanrl.rewards.worker import RewardWorker

_START_TIMEOUT_S = 300.0  # loading the reward module: generous for torch / transformers
_POLL_S = 0.1  # without pidfds, how often workers are checked for having died


class RewardWorkerPool:
    """`num_workers` slots of workers started with `init` (the pickled function, sys.path, ...).
    `loaded`: some worker has loaded the function (a start-up death is then not fatal)."""

    def __init__(self, num_workers: int, init: dict[str, Any]) -> None:
        self.slots: list[RewardWorker | None] = [None] * num_workers
        self.loaded = False
        self._init = init
        self._sel: selectors.BaseSelector | None = None

    def start(self) -> RewardWorker:
        """A new worker (it reports 'ready' once it has loaded the function)."""
        if self._sel is None:
            self._sel = selectors.DefaultSelector()
        return RewardWorker(self._sel, self._init)

    def start_missing(self) -> None:
        """Start a worker in every empty slot."""
        for slot, w in enumerate(self.slots):
            if w is None:
                self.slots[slot] = self.start()

    def replace_lost(self) -> None:
        """Start the workers the last batch lost (a worker still busy with a sample of a batch an
        exception cut short is killed first)."""
        for slot, w in enumerate(self.slots):
            if w is not None and w.sample is not None:
                w.kill()
                self.slots[slot] = None
        self.start_missing()

    def warm_up(self) -> None:
        """Start the workers the last batch lost; wait until every worker has loaded the function."""
        self.replace_lost()
        give_up = time.monotonic() + _START_TIMEOUT_S
        while any(w is not None and not w.ready for w in self.slots):
            left = give_up - time.monotonic()
            if left <= 0:
                self.close()
                raise RuntimeError(f"reward workers did not load the reward function within {_START_TIMEOUT_S:.0f} s")
            for event, w, payload in self.events(left):
                if event == "ready":
                    w.ready = self.loaded = True
                elif event == "dead":
                    self.slots[self.slots.index(w)] = None  # rests for this batch
                    if not self.loaded:
                        output, _ = w.take_output()
                        self.close()
                        raise RuntimeError(
                            f"the reward function cannot be loaded in a worker process ({payload}):\n{output}"
                        )

    def events(self, timeout: float) -> list[tuple[str, RewardWorker, Any]]:
        """Wait up to `timeout` s: [('ready' | 'result' | 'dead', worker, its message or how it died)]."""
        assert self._sel is not None, "events() before any worker started"
        out: list[tuple[str, RewardWorker, Any]] = []
        polled = any(w is not None and w.pidfd is None for w in self.slots)
        for key, _ in self._sel.select(min(timeout, _POLL_S) if polled else timeout):
            w, what = key.data
            if w.dead:
                continue
            if what == "output":
                w.read_output()
            elif what == "requests":
                w.write()
            else:  # its messages; "exit": it died, what it sent before it did comes first
                out += self._messages(w, dead=what == "exit")
        for w in self.slots:
            if polled and w is not None and not w.dead and w.pidfd is None and w.exited():
                out += self._messages(w, dead=True)
        return out

    def _messages(self, w: RewardWorker, dead: bool) -> list[tuple[str, RewardWorker, Any]]:
        out: list[tuple[str, RewardWorker, Any]]
        try:
            out = [("result" if len(m) == 5 else "ready", w, m) for m in w.read_results()]
        except ValueError as e:
            return [("dead", w, f"{w.kill()} after {e}")]
        if dead or w.results_closed:  # a worker that closed its result pipe is as good as dead
            out.append(("dead", w, w.kill()))
        return out

    def close(self) -> None:
        """Kill every worker and whatever it forked; a later call starts new ones."""
        for slot, w in enumerate(self.slots):
            if w is not None:
                w.kill()
            self.slots[slot] = None
        if self._sel is not None:
            self._sel.close()
            self._sel = None

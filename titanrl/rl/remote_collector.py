"""The trainer rank's rollout collector in one-step off-policy RL
(`rollout.mode = "one_step"`, `rl/one_step.py`): it sends the weights to its paired rollout rank and
receives the generated and scored batch (`rl/rollout_worker.py`) instead of generating it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from titanrl.components.timer import PhaseTimer
from titanrl.distributed import dp_max
from titanrl.rl.groups import Rollouts
from titanrl.rl.one_step import STOP, recv_object, roles, send_object, send_weights
from titanrl.rl.rollouts import RolloutCollector


class RemoteRolloutCollector(RolloutCollector):
    """The trainer ranks' `RolloutCollector`: batches come from the paired rollout rank."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start: int | None = None
        self.step = 0
        """Last step whose batch was received."""

    def collect(self, batches: Iterator, step: int, timer: PhaseTimer) -> tuple[Rollouts, Rollouts]:
        """The paired rollout rank's batch for `step` (with its counts), and the pair's lag and
        waits, the most of any trainer rank (collective over the data-parallel ranks)."""
        r, cfg = roles(), self.config
        next(batches)  # the rollout rank draws this batch; the checkpointed loader stays in step
        self.generator.sleep()  # only its weights are used here (sent to the rollout rank): no KV pool
        if self.start is None:  # the first step of this run (fresh or resumed)
            self.start = step
            send_object({"start": step}, r)
        # The generator was synced to the policy at this step's start: weights version step - 1
        # (versions count completed training steps).
        weights = self.generator.model
        one_step = cfg.rollout.staleness == 1
        if not one_step or step == self.start:  # this batch is generated with these weights
            send_weights(weights, step - 1, r)
        began = time.perf_counter()
        with timer("wait_rollouts"):
            out = recv_object(r)
        self.step = step
        if one_step and self.start < step < cfg.training.steps:  # for the batch after this one
            send_weights(weights, step - 1, r)
        lag, gen_s, idle_s, wait_s = dp_max(
            [
                float(step - 1 - out["version"]),
                out["seconds"].get("generate", 0.0),
                out["idle_s"],
                time.perf_counter() - began,
            ],
            self.host.dp_group,
        )
        metrics = {
            "version_lag_max": lag,
            "rollout_generate_s": gen_s,
            "rollout_idle_s": idle_s,
            "trainer_wait_s": wait_s,
        }
        return out["train"], dataclasses.replace(out["generated"], metrics=metrics)

    def close(self) -> None:
        """Release the rollout rank: after the last step it ends by itself; before (a stop on a
        signal, or a resumed run with nothing left to train) it is told to stop, once the batch
        it is sending (staleness 1) has been received."""
        r, steps = roles(), self.config.training.steps
        if self.start is not None and self.step >= steps:
            return
        if self.start is not None and self.config.rollout.staleness == 1:
            recv_object(r)  # batch step + 1, generated while step trained
            if self.step + 1 >= steps:  # it was the last: the rollout rank is done
                return
        send_object(STOP, r)

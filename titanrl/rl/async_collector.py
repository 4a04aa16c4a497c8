"""The trainer ranks' side of asynchronous RL (`rollout.mode = "async"`, `rl/async_roles.py`).

The hub (trainer rank 0) receives the rollout ranks' stream of finished, scored groups in a
thread per rollout rank. A step s first broadcasts weights version s-1 (every trainer rank
gathers its shards bucket by bucket, `rl/weight_broadcast.py`), then the hub waits until every
rollout rank has taken them (so that every group it had to send before is here) and at least
batch_size groups are queued, and picks the batch oldest first: by the version of a group's
oldest token, then by arrival. A group more than k = rollout.max_staleness versions behind is
dropped and counted (the rollout side's bound makes that not happen). The batch, ordered by the
groups' ids, is dealt to the trainer ranks as a synchronous run's loader would (rank r: groups
r, r+T, ...), then balanced by tokens as usual. The hub records every trained group's versions
in `async_groups.jsonl` and checkpoints the queued groups and the ids trained so far.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from titanrl.components.timer import PhaseTimer
from titanrl.generator import Completion
from titanrl.rewards.runner import RewardResult
from titanrl.rl.async_roles import SHARE, START, STOP_VERSION, STREAM, announce, async_roles, recv_object, send_object
from titanrl.rl.async_rollout import STAT_FIELDS
from titanrl.rl.groups import RolloutCounts, Rollouts
from titanrl.rl.rollouts import RolloutCollector
from titanrl.rl.weight_broadcast import bucket_layout, layout_digest, send_weights


class GroupQueue:
    """The hub's queue of finished groups, filled by one receiver thread per rollout rank."""

    def __init__(self, num_groups: int) -> None:
        self.cond = threading.Condition()
        self.groups: list[dict] = []
        self.arrivals = 0
        self.swapped = [-1] * num_groups  # each rollout group's latest weights version
        self.mid_decode = [0] * num_groups  # its swaps with samples in flight, so far
        self.stats = dict.fromkeys(STAT_FIELDS, 0)
        self.rollout_idle_s = 0.0
        self.threads: list[threading.Thread] = []
        self.error = ""

    def start(self) -> None:
        r = async_roles()
        for g, peer in enumerate(r.leaders):
            t = threading.Thread(target=self._receive, args=(g, peer), name=f"titanrl-stream-{g}", daemon=True)
            t.start()
            self.threads.append(t)

    def _receive(self, g: int, peer: int) -> None:
        try:
            self._receive_stream(g, peer)
        except BaseException as e:  # the step waiting for groups raises it, instead of waiting forever
            with self.cond:
                self.error = f"the stream of rollout group {g} (rank {peer}) broke: {type(e).__name__}: {e}"
                self.cond.notify_all()
            raise

    def _receive_stream(self, g: int, peer: int) -> None:
        r = async_roles()
        while True:
            message = recv_object(peer, STREAM, r)
            with self.cond:
                if message["kind"] == "bye":
                    self.cond.notify_all()
                    return
                for k in STAT_FIELDS:
                    self.stats[k] += message["stats"][k]
                self.rollout_idle_s += message["idle_s"]
                if message["kind"] == "swapped":
                    self.swapped[g], self.mid_decode[g] = message["version"], message["mid_decode"]
                for group in message.get("groups", []):
                    group["arrival"] = self.arrivals
                    self.arrivals += 1
                    self.groups.append(group)
                self.cond.notify_all()

    def take(self, version: int, n: int, k: int) -> tuple[list[dict], list[int]]:
        """Once every rollout rank has `version` and `n` groups within k versions of it are
        here: those n, oldest first (and the ids of those too stale, dropped)."""
        with self.cond:
            self.cond.wait_for(lambda: self.error or (min(self.swapped) >= version and len(self.groups) >= n))
            if self.error:
                raise RuntimeError(self.error)
            stale = [g for g in self.groups if version - g["min_version"] > k]
            self.groups = [g for g in self.groups if version - g["min_version"] <= k]
            self.cond.wait_for(lambda: len(self.groups) >= n)
            self.groups.sort(key=lambda g: (g["min_version"], g["arrival"]))
            picked, self.groups = self.groups[:n], self.groups[n:]
            return picked, [g["gid"] for g in stale]

    def drain_stats(self) -> tuple[dict[str, int], float]:
        with self.cond:
            stats, idle = self.stats, self.rollout_idle_s
            self.stats, self.rollout_idle_s = dict.fromkeys(STAT_FIELDS, 0), 0.0
            return stats, idle

    def join(self) -> None:
        for t in self.threads:
            t.join()


class AsyncRolloutCollector(RolloutCollector):
    """The trainer ranks' `RolloutCollector`: groups come from the rollout ranks' stream."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.baseline_rollout:
            raise ValueError("[rollout] mode = 'async' does not support algorithms with a baseline rollout (remax) yet")
        r = async_roles()
        self.roles = r
        self.queue = GroupQueue(r.num_groups) if r.is_hub else None
        self.start: int | None = None
        self.trained: set[int] = set()
        self.frontier = 0  # every group id below it is trained
        self.restored: list[dict] = []  # queued groups of the checkpoint, back in the queue at start
        self.stopped = False
        self.policy: torch.nn.Module | None = None
        self.sync_s = 0.0  # the last weight broadcast's seconds (waits for the rollout ranks included)
        self.dealt_at: float | None = None  # when the hub dealt the last batch

    def sync_generator(self, policy: torch.nn.Module) -> None:
        """The policy whose weights `collect` broadcasts to the rollout ranks."""
        self.policy = policy

    def collect(self, batches: Iterator, step: int, timer: PhaseTimer) -> tuple[Rollouts, Rollouts]:
        """This rank's share of the step's batch, with the step's stream metrics (the same on
        every trainer rank)."""
        r, cfg = self.roles, self.config
        next(batches)  # the rollout ranks draw the prompts; the checkpointed loader stays in step
        self.generator.sleep()  # its weights serve evaluations only: no KV pool
        if self.start is None:
            self._begin(step)
        with timer("sync"):
            assert self.policy is not None, "sync_generator() gives the policy at the step's start"
            self.sync_s = send_weights(self.policy, step - 1, r, self.generator.dtype, cfg.rollout.weight_bucket_mb)
        with timer("wait_rollouts"):
            share, metrics = self._hub_deal(step) if r.is_hub else recv_object(r.hub, SHARE, r)
        rollouts = _rollouts(share)
        if r.is_hub:
            rollouts.counts = metrics.pop("_counts")
        rollouts.metrics = metrics
        return rollouts, rollouts

    def _begin(self, step: int) -> None:
        r, cfg = self.roles, self.config
        self.start = step
        if not r.is_hub:
            return
        assert self.queue is not None
        assert self.policy is not None, "sync_generator() gives the policy at the step's start"
        layout = bucket_layout(self.policy, self.generator.dtype, cfg.rollout.weight_bucket_mb)
        skip = sorted(self.trained | {g["gid"] for g in self.restored}) + list(range(self.frontier))
        for peer in range(r.num_rollout):
            send_object({"version": step - 1, "skip": skip, "layout_digest": layout_digest(layout)}, peer, START, r)
        self.queue.groups.extend(self.restored)
        self.queue.arrivals = len(self.restored)
        self.restored = []
        self.queue.start()

    def _hub_deal(self, step: int) -> tuple[list[dict], dict[str, Any]]:
        """The hub: take the batch, deal the other trainer ranks their shares; returns its own."""
        r, cfg = self.roles, self.config
        assert self.queue is not None
        began = time.perf_counter()
        picked, dropped = self.queue.take(step - 1, cfg.training.batch_size, cfg.rollout.max_staleness)
        waited = time.perf_counter() - began
        picked.sort(key=lambda g: g["gid"])
        self._record(step, picked, dropped)
        stats, idle = self.queue.drain_stats()
        metrics = _stream_metrics(picked, step - 1, cfg.rollout.max_staleness, len(dropped), waited, idle, stats)
        # Per role, over the wall time since the last batch was dealt (a step, evaluations included).
        now = time.perf_counter()
        interval, self.dealt_at = now - (self.dealt_at or now), now
        if interval > 0:
            metrics["rollout_idle_frac"] = idle / (interval * r.num_groups)
            metrics["rollout_tokens_per_s"] = stats["decode_tokens"] / interval
            metrics["trainer_idle_frac"] = (waited + self.sync_s) / interval
        metrics["swaps_mid_decode"] = float(sum(self.queue.mid_decode))
        T = r.num_trainer
        for i in range(1, T):
            send_object((picked[i::T], metrics), i + r.num_rollout, SHARE, r)
        counts = RolloutCounts(
            gen_tokens=stats["decode_tokens"] + stats["prefill_tokens"], decode_steps=stats["decode_steps"]
        )
        return picked[0::T], {**metrics, "_counts": counts}

    def _record(self, step: int, picked: list[dict], dropped: list[int]) -> None:
        """Trained and dropped ids (checkpointed: a resumed run skips them), and each trained
        group's versions in async_groups.jsonl."""
        for gid in [g["gid"] for g in picked] + dropped:
            assert gid not in self.trained and gid >= self.frontier, f"group {gid} trained twice"
            self.trained.add(gid)
        while self.frontier in self.trained:
            self.trained.remove(self.frontier)
            self.frontier += 1
        folder = self.config.job.dump_folder
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "async_groups.jsonl"), "a") as f:
            for g in picked:
                row = {"step": step, "gid": g["gid"], "min_version": g["min_version"], "max_version": g["max_version"]}
                f.write(json.dumps(row) + "\n")

    # ---- end and checkpoints ----

    def close(self) -> None:
        """Stop the rollout ranks' streams (they end after their current pass) and wait for them."""
        r = self.roles
        if self.stopped or not r.is_hub:
            return
        self.stopped = True
        if self.start is None:  # they wait for the start message
            for peer in range(r.num_rollout):
                send_object(None, peer, START, r)
            return
        announce(STOP_VERSION, 0, r)
        assert self.queue is not None
        self.queue.join()

    def state_dict(self) -> dict[str, Any]:
        """The hub's queued groups and trained ids (plain containers: `weights_only` loads)."""
        if self.queue is None:
            return {}
        with self.queue.cond:
            queued = [_plain(g) for g in self.queue.groups]
        return {"frontier": self.frontier, "trained": sorted(self.trained), "queued": queued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state or self.queue is None:
            return
        self.frontier, self.trained = state["frontier"], set(state["trained"])
        self.restored = [_from_plain(g) for g in state["queued"]]


def _stream_metrics(
    picked: list[dict], version: int, k: int, dropped: int, waited: float, idle: float, stats: dict[str, int]
) -> dict[str, float]:
    """Staleness of the trained tokens (histogram over 0..k versions), the waits, the drops."""
    lags = [version - v for g in picked for c in g["completions"] for v in (c.versions or [])]
    hist = {f"stale_tokens_{d}": float(sum(lag == d for lag in lags)) / max(len(lags), 1) for d in range(k + 1)}
    return {
        "version_lag_max": float(max((version - g["min_version"] for g in picked), default=0)),
        "version_lag_mean": sum(lags) / max(len(lags), 1),
        **hist,
        "groups_dropped": float(dropped),
        "trainer_wait_s": waited,
        "rollout_idle_s": idle,
        "rollout_decode_tokens": float(stats["decode_tokens"]),
    }


def _rollouts(share: list[dict]) -> Rollouts:
    """A share's groups as `Rollouts` (G consecutive completions per prompt)."""
    completions = []
    for i, g in enumerate(share):
        for c in g["completions"]:
            completions.append(dataclasses.replace(c, prompt_index=i))
    return Rollouts(
        [g["prompt"] for g in share],
        completions,
        [res for g in share for res in g["results"]],
        [x for g in share for x in g["rewards"]],
    )


def _plain(g: dict) -> dict:
    return {
        **{k: v for k, v in g.items() if k not in ("completions", "results")},
        "completions": [dataclasses.asdict(c) for c in g["completions"]],
        "results": [dataclasses.asdict(x) for x in g["results"]],
    }


def _from_plain(g: dict) -> dict:
    return {
        **g,
        "completions": [Completion(**c) for c in g["completions"]],
        "results": [RewardResult(**x) for x in g["results"]],
    }

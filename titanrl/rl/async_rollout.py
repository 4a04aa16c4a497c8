"""A rollout rank of asynchronous RL (`rollout.mode = "async"`, `rl/async_roles.py`).

It runs one endless generator stream (`Generator.stream`). Before every scheduler pass its feed:
  1. stamps the tokens of the last pass with the weight version that sampled them;
  2. scores the groups whose G samples have all finished and sends them to the hub;
  3. swaps in announced weights, when the staleness bound allows (below), without dropping the
     samples in flight or their KV (`rollout.recompute_kv` prefills them again instead);
  4. adds prompts of its data shard while the bound allows.

The bound, with k = rollout.max_staleness and B = training.batch_size: trainer step s trains
from weights version s-1 (versions count updates), so a group whose oldest token has version v
must be trained by step v+k+1, whose batch the hub picks after this rank took version v+k.
With rollout.stale_groups = 'wait' (the default) two rules keep every group within it:
  - admission: the n-th group of the global stream (batch n // B + 1) starts only while this
    rank's version v has batch <= v+k+1: no more groups are started than steps can train in time;
  - swap: version w is taken only when every group whose oldest token has a version <= w-k has
    been sent (and no group that would hold it back is started meanwhile).
The hub trains the oldest groups first (`rl/async_collector.py`), so every group is trained
within k versions and none is dropped. k = 0 is the synchronous run: batch s is admitted at once
under version s-1, decoded to its end and sent, then version s is taken. With 'drop', swaps are
never held back (the trainer does not wait for stragglers) and the hub drops late groups.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanrl.components.faults import fault_point
from titanrl.components.launch import StopSignals, die_with_launcher, local_device, model_args
from titanrl.config import JobConfig
from titanrl.data.encode import PromptEncoder, fit_prompts
from titanrl.data.loader import load_data
from titanrl.data.prompts import build_prompt_loader, prompt_stream
from titanrl.data.tasks import Sample
from titanrl.distributed import set_determinism
from titanrl.envs.builtin import ALL_TASKS
from titanrl.generator.sequence import Seq
from titanrl.generator.stream import StreamScheduler, forget_prefixes, stream
from titanrl.models.tokenizer import build_tokenizer
from titanrl.rl.async_roles import (
    START,
    STOP_VERSION,
    STREAM,
    AnnouncementListener,
    AsyncRoles,
    async_roles,
    recv_object,
    send_object,
)
from titanrl.rl.builders import build_generator, build_reward_runner
from titanrl.rl.rollout_worker import RolloutRankHost, _Shard
from titanrl.rl.rollouts import group_sampling_params, step_seed
from titanrl.rl.scoring import Scorer
from titanrl.rl.weight_broadcast import bucket_layout, layout_digest, receive_weights

STAT_FIELDS = ("decode_tokens", "prefill_tokens", "decode_steps", "preemptions", "prefix_cache_hit_tokens")
"""Stream counters reported to the hub as deltas with every message."""


@dataclass
class StreamGroup:
    """A group in flight: its prompt and the samples finished so far."""

    gid: int
    """Global id: (batch - 1) * B + position in the batch."""
    sample: Sample
    prompt: list[int]
    finished: list[Seq] = field(default_factory=list)

    def oldest_version(self) -> int:
        return min(s.versions[0] for s in self.finished if s.versions)


@dataclass
class Decision:
    """What a rollout group does before a pass, decided by its leader (`StreamDriver._decide`)."""

    stop: bool = False
    swap: tuple[int, int] | None = None
    """(version, buckets) to take now."""
    pending: int | None = None
    """A version announced but not taken yet: admission must not hold it back further."""

    def pack(self) -> list[int]:
        swap = self.swap or (-1, 0)
        return [int(self.stop), swap[0], swap[1], -1 if self.pending is None else self.pending]

    @staticmethod
    def unpack(values: list[int]) -> Decision:
        stop, version, buckets, pending = values
        return Decision(bool(stop), (version, buckets) if version >= 0 else None, None if pending < 0 else pending)


class AsyncRolloutWorker:
    """A rollout rank: its own generator, reward workers and data shard, one endless stream."""

    def __init__(self, config: JobConfig) -> None:
        r, cfg = async_roles(), config
        self.config, self.roles = config, r
        die_with_launcher()
        self.stop_signals = StopSignals()  # the trainer ranks stop the run (and this rank) on a signal
        set_determinism(cfg.job.seed, cfg.job.deterministic)
        tokenizer = build_tokenizer(cfg.model.tokenizer)
        args = model_args(cfg, tokenizer.vocab_size)
        self.encode = PromptEncoder.from_config(cfg.data, cfg.model.tokenizer, tokenizer)
        device = local_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        split = load_data(cfg, "prompts", ALL_TASKS)
        train, _ = fit_prompts(cfg, args.max_seq_len, self.encode, split.train, split.held_out)
        tp_mesh = rollout_tp_mesh(r, device)
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        self.generator = build_generator(cfg, args, device, tokenizer, tp_mesh)
        # The group's leader scores and sends its groups: only it runs reward workers.
        self.rewards = build_reward_runner(cfg, split.task) if r.is_leader else None
        host = RolloutRankHost(cfg, _Shard(r.group, r.num_groups), tokenizer, self.encode, device)
        self.scorer = Scorer(host, self.rewards, None) if self.rewards is not None else None
        self.tokenizer = tokenizer
        self.loader = build_prompt_loader(
            prompt_stream(train, split.task, cfg.job.seed), cfg.training.batch_size, r.group, r.num_groups
        )

    def run(self) -> None:
        r = self.roles
        start = recv_object(r.hub, START, r)
        try:
            if start is not None:  # None: the trainer stopped before its first step
                self._check_layout(start["layout_digest"])
                StreamDriver(self, start).run()
        finally:
            if self.rewards is not None:
                self.rewards.close()

    def _check_layout(self, digest: str) -> None:
        cfg = self.config
        mine = layout_digest(bucket_layout(self.generator.model, self.generator.dtype, cfg.rollout.weight_bucket_mb))
        if mine != digest:
            raise ValueError(
                f"async rollout rank {self.roles.index}: its generator's parameters (names, shapes, dtype) "
                "differ from the trainer's; both sides must build the same [model]"
            )


def rollout_tp_mesh(r: AsyncRoles, device: torch.device) -> DeviceMesh | None:
    """The tp mesh of this rank's rollout group (over the rollout ranks' own process group),
    or None when each rollout rank serves a whole generator."""
    if r.tp == 1:
        return None
    mesh = init_device_mesh(device.type, (r.num_groups, r.tp), mesh_dim_names=("rollout_dp", "tp"))
    return mesh["tp"]


class StreamDriver:
    """The feed of one rollout rank's stream (see the module docstring)."""

    def __init__(self, worker: AsyncRolloutWorker, start: dict) -> None:
        cfg = worker.config
        self.worker, self.config, self.roles = worker, cfg, worker.roles
        self.gen = worker.generator
        self.k, self.B = cfg.rollout.max_staleness, cfg.training.batch_size
        self.share = self.B // self.roles.num_groups  # this rollout group's groups per batch
        self.skip: set[int] = set(start["skip"])  # trained or queued at the hub: not again
        self.batches: Iterator[list[Sample]] = iter(worker.loader)
        self.pending: list[tuple[int, Sample]] = []  # (gid, sample) drawn, not yet admitted
        self.admitted = 0  # this rank's groups taken from its loader (started, or skipped)
        self.version, self.has_weights = start["version"], False  # the first announcement brings them
        self.sched: StreamScheduler | None = None
        self.in_flight: dict[int, StreamGroup] = {}  # by the scheduler's prompt index
        self.listener = AnnouncementListener(self.roles) if self.roles.is_leader else None
        self.tp_group = worker.tp_group
        self.stats_sent = dict.fromkeys(STAT_FIELDS, 0)
        self.idle_s, self.swaps_mid_decode = 0.0, 0
        self.params = group_sampling_params(cfg, 0)  # each group brings its own seed (`_add`)

    def run(self) -> None:
        stream(self.gen, self, self.params)
        if self.roles.is_leader:
            send_object({"kind": "bye"}, self.roles.hub, STREAM, self.roles)

    def __call__(self, sched: StreamScheduler) -> bool:
        self.sched = sched
        sched.stamp_versions(self.version)
        if self.roles.is_leader:
            self._send_finished(sched)
        else:  # the group's leader scores and sends them (the same samples on every tp rank)
            self._group_finished(sched)
        while True:
            decision = self._agree(self._decide(sched) if self.roles.is_leader else None)
            if decision.stop:
                return False
            if decision.swap is not None:
                self._swap(sched, *decision.swap)
            self._admit(sched, decision.pending)
            if sched.has_work:
                return True
            if self.listener is not None:  # nothing to decode: wait for the next weights
                began = time.perf_counter()
                self.listener.wait()
                self.idle_s += time.perf_counter() - began

    # ---- finished groups ----

    def _group_finished(self, sched: StreamScheduler) -> list[StreamGroup]:
        """The groups whose last samples finished in the last pass (no longer in flight)."""
        done = []
        for seq in sched.take_finished():
            group = self.in_flight[seq.prompt_index]
            group.finished.append(seq)
            if len(group.finished) == self.params.n:
                done.append(self.in_flight.pop(seq.prompt_index))
        return done

    def _send_finished(self, sched: StreamScheduler) -> None:
        done = self._group_finished(sched)
        if done:
            self._send({"kind": "groups", "groups": self._scored(done)})

    def _scored(self, groups: list[StreamGroup]) -> list[dict]:
        tok = self.worker.tokenizer
        completions = []
        for i, g in enumerate(groups):
            for s in sorted(g.finished, key=lambda s: s.sample_index):
                c = s.to_completion(tok)
                c.prompt_index = i
                completions.append(c)
        prompts = [g.prompt for g in groups]
        assert self.worker.scorer is not None, "the group's leader scores"
        results, rewards_N, _ = self.worker.scorer.score([g.sample for g in groups], prompts, completions, None)
        G, rewards = self.params.n, rewards_N.tolist()
        out = []
        for i, g in enumerate(groups):
            cs = completions[i * G : (i + 1) * G]
            versions = [v for c in cs for v in (c.versions or [])]
            out.append(
                {
                    "gid": g.gid,
                    "prompt": g.prompt,
                    "completions": cs,
                    "results": results[i * G : (i + 1) * G],
                    "rewards": rewards[i * G : (i + 1) * G],
                    "min_version": min(versions, default=self.version),
                    "max_version": max(versions, default=self.version),
                }
            )
        return out

    def _send(self, message: dict) -> None:
        stats = self.stats_now()
        message["stats"] = {k: stats[k] - self.stats_sent[k] for k in STAT_FIELDS}
        message["idle_s"], self.idle_s = self.idle_s, 0.0
        self.stats_sent = stats
        send_object(message, self.roles.hub, STREAM, self.roles)

    def stats_now(self) -> dict[str, int]:
        assert self.sched is not None, "messages are sent from inside the stream"
        return {k: getattr(self.sched.stats, k) for k in STAT_FIELDS}

    # ---- weights ----

    def _decide(self, sched: StreamScheduler) -> Decision:
        """The leader's view of the announcements: stop, swap now, or a swap pending."""
        assert self.listener is not None, "the group's leader listens to the hub"
        announced = self.listener.pending()
        if announced is None:
            return Decision()
        version, buckets = announced
        if version == STOP_VERSION:
            return Decision(stop=True)
        if self.config.rollout.stale_groups == "drop":  # never hold a swap back: the hub drops what is late
            self.listener.take()
            return Decision(swap=(version, buckets))
        if any(g.finished and g.oldest_version() <= version - self.k for g in self.in_flight.values()):
            return Decision(pending=version)  # a group due before this version's batch is still decoding
        if self._started_unfinished(sched, version):
            return Decision(pending=version)
        self.listener.take()
        return Decision(swap=(version, buckets))

    def _agree(self, decision: Decision | None) -> Decision:
        """The leader's decision, on every tp rank of its rollout group (they run one schedule)."""
        if self.tp_group is None:
            assert decision is not None
            return decision
        buf = torch.tensor(decision.pack() if decision is not None else [0] * 4, dtype=torch.int64)
        dist.broadcast(buf, group=self.tp_group, group_src=0)
        return Decision.unpack(buf.tolist())

    def _swap(self, sched: StreamScheduler, version: int, buckets: int) -> None:
        fault_point("rollout_swap", version)  # kill -9 tests: a rollout rank dies mid-run
        cfg = self.config.rollout
        receive_weights(self.gen.model, buckets, self.roles, self.gen.dtype, cfg.weight_bucket_mb)
        forget_prefixes(self.gen)
        if sched.running or sched.prefilling:
            self.swaps_mid_decode += 1
            if cfg.recompute_kv:
                sched.recompute_all()
        self.version, self.has_weights = version, True
        if self.roles.is_leader:
            self._send({"kind": "swapped", "version": version, "mid_decode": self.swaps_mid_decode})

    def _started_unfinished(self, sched: StreamScheduler, version: int) -> bool:
        """Whether a sample in flight has a token of a version <= `version` - k (a group whose
        first samples have not finished yet: `StreamGroup.finished` does not see it)."""
        live = sched.running + sched.prefilling + sched.waiting
        return any(s.versions and s.versions[0] <= version - self.k for s in live)

    # ---- admission ----

    def _admit(self, sched: StreamScheduler, pending: int | None) -> None:
        # A group started now gets tokens of this version: it would hold back the pending swap.
        if pending is not None and self.version <= pending - self.k:
            return
        if not self.has_weights:
            return
        limit = (self.version + self.k + 1) * self.share  # this rank's groups of batches <= v+k+1
        new: list[tuple[int, Sample]] = []
        while self.admitted < limit:
            if not self.pending:
                self._draw()
            gid, sample = self.pending.pop(0)
            self.admitted += 1
            if gid not in self.skip:  # trained or queued before a resume: never twice
                new.append((gid, sample))
        if new:
            self._add(sched, new)

    def _draw(self) -> None:
        """This rollout group's share of the next global batch (its loader batch)."""
        R, i = self.roles.num_groups, self.roles.group
        b = self.admitted // self.share  # batches are drawn in order, one loader batch each
        self.pending.extend((b * self.B + j * R + i, s) for j, s in enumerate(next(self.batches)))

    def _add(self, sched: StreamScheduler, new: list[tuple[int, Sample]]) -> None:
        prompts = [self.worker.encode(s.prompt, s.metadata) for _, s in new]
        # The synchronous run's keys: seeded by (job seed, step) and the prompt's place in its batch.
        seeds = [step_seed(self.config.job.seed, gid // self.B + 1) for gid, _ in new]
        indices = sched.add_prompts(prompts, [gid % self.B for gid, _ in new], seeds)
        for index, (gid, s), prompt in zip(indices, new, prompts):
            self.in_flight[index] = StreamGroup(gid, s, prompt)

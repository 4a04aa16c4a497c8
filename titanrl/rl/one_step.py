"""One-step off-policy RL on disaggregated ranks (`rollout.mode = "one_step"`).

The torchrun world is split in two halves: ranks 0..R-1 generate and score (`RolloutWorker`),
ranks R..2R-1 train (the ordinary `Trainer`, whose process group holds only them, so that its
collectives, FSDP2 and checkpoints are those of an R-rank job). Rollout rank i feeds trainer
rank i, which takes data shard i: the prompts, seeds and samples of a synchronous R-rank run.
A separate gloo group over the whole world carries, between the ranks of a pair, the rollouts
(pickled) and the weights (the trainer's generator copy: whole tensors, sent in place).

Batch k is generated with weights version max(0, k - 1 - staleness) (version v: after v updates):
  staleness 0: trainer step k sends version k-1, then waits for batch k; the rollout rank waits
               for the weights, generates, sends. No overlap; the same run as synchronous.
  staleness 1: trainer step k receives batch k (generated during step k-1), sends version k-1,
               trains; meanwhile the rollout rank generates batch k+1 with it. One step of overlap.
Both sides send and receive in the same order, so blocking transfers cannot deadlock. A resumed
run starts both sides at the checkpoint's weights (its first two batches share them).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titanrl.algorithms import get_algorithm
from titanrl.components.launch import StopSignals, die_with_launcher, local_device, model_args
from titanrl.components.timer import PhaseTimer
from titanrl.components.watchdog import Watchdog
from titanrl.config import JobConfig
from titanrl.data.encode import PromptEncoder, fit_prompts
from titanrl.data.loader import load_data
from titanrl.data.prompts import build_prompt_loader, prompt_stream
from titanrl.distributed import dp_max, set_determinism
from titanrl.envs.builtin import ALL_TASKS
from titanrl.models.tokenizer import build_tokenizer
from titanrl.rl.builders import build_generator, build_reward_runner
from titanrl.rl.groups import Rollouts
from titanrl.rl.rollouts import RolloutCollector


@dataclass
class Roles:
    """This process's side of a one-step job and the group both sides talk over."""

    rollout: bool
    index: int
    """Pair index: rollout rank i and trainer rank R + i (trainer-local rank i)."""
    num_pairs: int
    group: dist.ProcessGroup
    """Gloo over the whole torchrun world (global ranks)."""

    @property
    def partner(self) -> int:
        return self.index + self.num_pairs if self.rollout else self.index


_roles: Roles | None = None


def roles() -> Roles:
    assert _roles is not None, "one_step roles are set up by split_world() before the Trainer is built"
    return _roles


# A rollout rank waits for its trainer through model building, SFT warm-up, evaluations and
# checkpoints: the pair's transfers must not time out on those (the trainer's watchdog catches
# real hangs, and torchrun ends the job when either side dies).
_PAIR_TIMEOUT_S = 7 * 24 * 3600.0


def split_world(config: JobConfig, timeout_s: float = _PAIR_TIMEOUT_S) -> Roles:
    """Join the whole world's gloo group, then make the trainer half an R-rank job: its
    `init_distributed` (inside the Trainer) sees RANK / WORLD_SIZE of the trainer ranks only."""
    global _roles
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    R = config.rollout.rollout_ranks
    if world != 2 * R:
        raise ValueError(
            f"[rollout] mode = 'one_step' with rollout_ranks = {R} needs {2 * R} ranks ({R} generate, {R} train), "
            f"got {world}; launch torchrun --nproc_per_node={2 * R} or change rollout.rollout_ranks"
        )
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(f"titanrl/one_step_{attempt}", store), rank, world, timedelta(seconds=timeout_s)
    )
    # A gloo backend serves as the group (torch's hints ask for a ProcessGroup).
    _roles = Roles(rollout=rank < R, index=rank % R, num_pairs=R, group=group)  # type: ignore[arg-type]
    if not _roles.rollout:  # LOCAL_RANK stays: it picks this process's own GPU
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank - R), str(R)
    return _roles


# ---- transfers between the ranks of a pair ----


def send_object(obj: Any, r: Roles) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    r.group.send([torch.tensor([data.numel()], dtype=torch.int64)], r.partner, 0).wait()
    r.group.send([data], r.partner, 1).wait()


def recv_object(r: Roles) -> Any:
    size = torch.empty(1, dtype=torch.int64)
    r.group.recv([size], r.partner, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    r.group.recv([data], r.partner, 1).wait()
    return pickle.loads(data.numpy().tobytes())


@torch.no_grad()
def send_weights(model: torch.nn.Module, version: int, r: Roles) -> None:
    send_object(version, r)
    for p in model.parameters():
        r.group.send([p.detach().contiguous().cpu()], r.partner, 2).wait()


@torch.no_grad()
def recv_weights(model: torch.nn.Module, r: Roles) -> int | None:
    """The weights' version, or None: the trainer stopped (STOP instead of weights)."""
    version = recv_object(r)
    if version is STOP:
        return None
    for p in model.parameters():
        buf = torch.empty(p.shape, dtype=p.dtype)
        r.group.recv([buf], r.partner, 2).wait()
        p.copy_(buf)
    return version


STOP = None
"""Sent where the rollout rank expects the start message or weights: the trainer is done."""


def receives_weights(step: int, start: int, staleness: int) -> bool:
    """Whether the weights cross before batch `step` (first batch of this run: `start`)."""
    return staleness == 0 or step == start or step >= start + 2


# ---- trainer side ----


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


# ---- rollout side ----


@dataclass
class _Shard:
    dp_rank: int
    dp_size: int


@dataclass
class RolloutRankHost:
    """A rollout rank's `RolloutHost`: what `RolloutCollector` needs, without a model to train
    (its collector runs no collective over dp ranks: each rollout rank feeds its own trainer rank)."""

    config: JobConfig
    dims: Any  # a `_Shard`: the dp_rank / dp_size the collector reads
    tokenizer: Any
    encode_prompt: Any
    device: torch.device
    dp_group: dist.ProcessGroup | None = None  # never set: no collective over rollout ranks
    rank: int = dataclasses.field(default_factory=lambda: dist.get_rank() if dist.is_initialized() else 0)


class RolloutWorker:
    """A rollout rank: its own generator, reward workers and data shard; generates and scores
    batches for its trainer rank and takes the new weights as they come."""

    def __init__(self, config: JobConfig) -> None:
        r, cfg = roles(), config
        self.config, self.roles = config, r
        die_with_launcher()
        # SIGTERM / SIGUSR1 go to every rank: the trainer ranks stop at a step boundary with a
        # checkpoint and then stop this rank (`RemoteRolloutCollector.close`); it must not die first.
        self.stop_signals = StopSignals()
        set_determinism(cfg.job.seed, cfg.job.deterministic)
        tokenizer = build_tokenizer(cfg.model.tokenizer)
        args = model_args(cfg, tokenizer.vocab_size)
        encode = PromptEncoder.from_config(cfg.data, cfg.model.tokenizer, tokenizer)
        device = local_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        split = load_data(cfg, "prompts", ALL_TASKS)
        task, train, held_out = split.task, split.train, split.held_out
        train, _ = fit_prompts(cfg, args.max_seq_len, encode, train, held_out)
        self.generator = build_generator(cfg, args, device, tokenizer)
        self.rewards = build_reward_runner(cfg, task)
        baseline = get_algorithm(cfg.algorithm.name)(cfg.algorithm).needs_baseline_rollout
        host = RolloutRankHost(cfg, _Shard(r.index, r.num_pairs), tokenizer, encode, device)
        self.collector = RolloutCollector(host, self.generator, self.rewards, None, None, baseline)
        self.loader = build_prompt_loader(
            prompt_stream(train, task, cfg.job.seed), cfg.training.batch_size, r.index, r.num_pairs
        )
        self.watchdog = Watchdog(cfg.job.phase_timeout_s, -1)

    def run(self) -> None:
        r, cfg = self.roles, self.config
        message = recv_object(r)
        if message is STOP:
            return self.rewards.close()
        start = message["start"]
        batches = iter(self.loader)
        for _ in range(start - 1):  # a resumed run: the batches trained before its checkpoint
            next(batches)
        version, idle = 0, 0.0
        try:
            for step in range(start, cfg.training.steps + 1):
                began = time.perf_counter()
                if receives_weights(step, start, cfg.rollout.staleness):
                    received = recv_weights(self.generator.model, r)
                    if received is None:  # the trainer stopped early
                        break
                    version = received
                    if self.generator.allocator is not None:  # cached prefixes hold old weights' K/V
                        self.generator.allocator.reset_prefix_cache()
                idle += time.perf_counter() - began
                timer = PhaseTimer(self.watchdog, self.generator.device)
                train, generated = self.collector.collect(batches, step, timer)
                began = time.perf_counter()
                send_object(
                    {
                        "train": train,
                        "generated": generated,
                        "version": version,
                        "seconds": dict(timer.seconds),
                        "idle_s": idle,
                    },
                    r,
                )
                # Waiting for the trainer to take the batch is idle too: reported with the next one.
                idle = time.perf_counter() - began
        finally:
            self.rewards.close()

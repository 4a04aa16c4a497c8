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

This module splits the world and carries objects and weights within a pair; the rollout rank's
loop is `rl/rollout_worker.py`, the trainer rank's collector `rl/remote_collector.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titanrl.config import JobConfig
from titanrl.distributed.utils import recv_pickled, send_pickled


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
    send_pickled(obj, r.group, r.partner, 0)


def recv_object(r: Roles) -> Any:
    return recv_pickled(r.group, r.partner, 0)


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


# ---- rollout side ----

"""Asynchronous RL's ranks and what crosses between them (`rollout.mode = "async"`).

The torchrun world is split in two: ranks 0..R-1 decode a continuous stream (`rl/async_rollout.py`),
ranks R..W-1 train (the ordinary `Trainer`, whose process group holds only them, so that its
collectives, FSDP2 / TP and checkpoints are those of a (W-R)-rank job). Trainer rank 0, global
rank R, is the hub: it receives every finished group, picks each step's batch and hands the other
trainer ranks their share (`rl/async_collector.py`).

Three channels:
  - the world's gloo group carries small objects (finished groups, their token ids and floats;
    shares; the start message), point to point, each kind under its own tag;
  - an announcement (a 2-int tensor: version, buckets) from the hub to every rollout rank says
    that new weights follow; the rollout rank's listener thread receives it, and the decode loop
    looks at it between two passes;
  - the weights themselves cross in `torch.distributed` broadcasts over the sync group (the hub
    and the rollout ranks; NCCL on GPU, gloo on CPU), in buckets (`rl/weight_broadcast.py`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titanrl.config import JobConfig
from titanrl.distributed.utils import recv_pickled, send_pickled

TAG_SIZE, TAG_ANNOUNCE = 0, 2
"""Point-to-point tags: an object of a kind takes tags kind + 0 (its size) and kind + 1 (its
bytes, `send_pickled`); announcements take their own."""

STREAM, SHARE, START = 10, 20, 30
"""Tag offsets of the object kinds: rollout -> hub groups, hub -> trainer shares, hub -> rollout start."""

STOP_VERSION = -1
"""Announced instead of a version: the trainer is done; the rollout rank ends its stream."""

# A rollout rank waits for its trainer through model building, SFT warm-up, evaluations and
# checkpoints: transfers must not time out on those (the trainer's watchdog catches real hangs,
# and torchrun ends the job when any rank dies).
_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class AsyncRoles:
    """This process's side of an async job and the groups it talks over."""

    rollout: bool
    index: int
    """Rollout rank index (0..R-1), or trainer-local rank (0..T-1)."""
    num_rollout: int
    num_trainer: int
    world: dist.ProcessGroup
    """Gloo over the whole torchrun world (global ranks)."""
    sync: dist.ProcessGroup | None
    """The hub (group rank R) and the rollout ranks (0..R-1); None on other trainer ranks."""
    tp: int = 1
    """Rollout ranks per generator (a rollout group, tensor-parallel; `rollout.tp`)."""

    @property
    def num_groups(self) -> int:
        """Rollout groups: each serves one generator and one data shard."""
        return self.num_rollout // self.tp

    @property
    def group(self) -> int:
        """This rollout rank's group."""
        return self.index // self.tp

    @property
    def is_leader(self) -> bool:
        """The rollout rank that talks to the hub for its group (its tp rank 0)."""
        return self.rollout and self.index % self.tp == 0

    @property
    def leaders(self) -> list[int]:
        """Global ranks of the rollout groups' leaders."""
        return list(range(0, self.num_rollout, self.tp))

    @property
    def hub(self) -> int:
        """Global rank of trainer rank 0."""
        return self.num_rollout

    @property
    def is_hub(self) -> bool:
        return not self.rollout and self.index == 0


_roles: AsyncRoles | None = None


def async_roles() -> AsyncRoles:
    assert _roles is not None, "async roles are set up by split_async_world() before the Trainer is built"
    return _roles


def split_async_world(config: JobConfig, timeout_s: float = _TIMEOUT_S) -> AsyncRoles:
    """Join the world's gloo group (and the sync group on its members), then make the trainer
    ranks a (W-R)-rank job: their `init_distributed` sees RANK / WORLD_SIZE of the trainer only."""
    global _roles
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    R = config.rollout.rollout_ranks
    if world <= R:
        raise ValueError(
            f"[rollout] mode = 'async' with rollout_ranks = {R} needs more than {R} ranks (at least one trains), "
            f"got {world}; launch torchrun --nproc_per_node={R + 1} or more, or lower rollout.rollout_ranks"
        )
    T, tp = world - R, config.rollout.tp
    if R % tp:
        raise ValueError(
            f"[rollout] rollout.tp ({tp}) must divide rollout.rollout_ranks ({R}): one generator per tp ranks"
        )
    if config.training.batch_size % (R // tp) or config.training.batch_size % T:
        raise ValueError(
            f"[rollout] mode = 'async': training.batch_size ({config.training.batch_size}) must divide among the "
            f"{R // tp} rollout groups and the {T} trainer ranks; change the batch size or rollout.rollout_ranks"
        )
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"titanrl/async_{attempt}", store), rank, world, timeout)
    sync = None
    if rank <= R:  # the rollout ranks and the hub
        sync = _sync_group(dist.PrefixStore(f"titanrl/async_sync_{attempt}", store), rank, R + 1, timeout)
    rollout = rank < R
    if rollout and tp > 1:  # the rollout ranks' own world: their groups' tp meshes live in it
        backend = "nccl" if _use_nccl() else "gloo"
        rollout_store = dist.PrefixStore(f"titanrl/async_rollout_{attempt}", store)
        dist.init_process_group(backend, store=rollout_store, rank=rank, world_size=R, timeout=timeout)
    _roles = AsyncRoles(rollout, rank if rollout else rank - R, R, T, group, sync, tp)  # type: ignore[arg-type]
    if not rollout:  # LOCAL_RANK stays: it picks this process's own GPU
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank - R), str(T)
    return _roles


def _use_nccl() -> bool:
    """Whether every local rank has a GPU of its own (the weights are on them)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _sync_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """NCCL where every local rank has a GPU of its own, else gloo (through host memory)."""
    if _use_nccl():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)  # type: ignore[return-value]
    return dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[return-value]


# ---- objects between two ranks of the world group ----


def send_object(obj: Any, peer: int, kind: int, r: AsyncRoles) -> None:
    """Pickled plain objects (token ids, floats, dicts): never tensors' storage."""
    send_pickled(obj, r.world, peer, kind + TAG_SIZE)


def recv_object(peer: int, kind: int, r: AsyncRoles) -> Any:
    return recv_pickled(r.world, peer, kind + TAG_SIZE)


# ---- announcements: hub -> rollout ranks ----


def announce(version: int, num_buckets: int, r: AsyncRoles) -> None:
    """Tell every rollout group's leader that `version`'s weights follow in `num_buckets`
    broadcasts (or, with STOP_VERSION, that the run is over)."""
    works = [
        r.world.send([torch.tensor([version, num_buckets], dtype=torch.int64)], peer, TAG_ANNOUNCE)
        for peer in r.leaders
    ]
    for w in works:
        w.wait()


class AnnouncementListener:
    """A rollout rank's thread that receives the hub's announcements; the decode loop polls
    `pending` between passes without blocking, or `wait`s when it has nothing to decode."""

    def __init__(self, r: AsyncRoles) -> None:
        self._roles, self._cond = r, threading.Condition()
        self._queue: list[tuple[int, int]] = []
        self._thread = threading.Thread(target=self._run, name="titanrl-announcements", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            buf = torch.empty(2, dtype=torch.int64)
            self._roles.world.recv([buf], self._roles.hub, TAG_ANNOUNCE).wait()
            version, buckets = buf.tolist()
            with self._cond:
                self._queue.append((version, buckets))
                self._cond.notify_all()
            if version == STOP_VERSION:
                return

    def pending(self) -> tuple[int, int] | None:
        """The oldest announcement not yet taken (version, buckets), or None."""
        with self._cond:
            return self._queue[0] if self._queue else None

    def take(self) -> tuple[int, int]:
        with self._cond:
            return self._queue.pop(0)

    def wait(self) -> None:
        """Block until an announcement is pending."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue))

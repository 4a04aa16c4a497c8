import ctypes
import os
import pickle
import random
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from titanrl.distributed.parallel_dims import device_type


def init_distributed(timeout_s: float = 600.0, single_process_group: bool = False) -> tuple[int, int]:
    """Join the torchrun process group (gloo on CPU, NCCL for CUDA tensors); returns (rank, world).

    Outside torchrun (no WORLD_SIZE) this is a single-process job: no group is created unless
    `single_process_group` asks for a one-rank group (FSDP2's mixed precision needs a mesh).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    single = world_size == 1 and "RANK" not in os.environ
    if single and not single_process_group:
        return 0, 1
    if device_type() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        # One rank needs no rendezvous: an in-memory store, no MASTER_ADDR / port.
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if single else _attempt_store(timeout_s)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **store)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout_s: float) -> dict:
    """torchrun's store, under a prefix per restart: workers restarted by `--max-restarts` share
    the agent's store with the attempt before, and could read the dead ranks' gloo addresses
    (seen as 'Connection refused' in connectFullMesh after a restart)."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"titanrl/attempt_{attempt}", store), "rank": rank, "world_size": world_size}


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every RNG the same on all ranks (model init must agree before sharding)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if torch.cuda.is_available():
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False


def all_reduce_values(
    values: list[float], group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> list[float]:
    """Reduce a few host numbers (metrics, counts) over `group` in float64; None = one process."""
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def dp_sum(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Host numbers summed over the data-parallel `group` (TP peers hold equal copies, not counted)."""
    return all_reduce_values(values, group)


def dp_max(values: list[float], group: dist.ProcessGroup | None) -> list[float]:
    """Host numbers' maximum over the data-parallel `group`."""
    return all_reduce_values(values, group, op=dist.ReduceOp.MAX)


def return_freed_host_memory() -> None:
    """On Linux CPU runs, hand the host memory that glibc keeps after frees back to the system
    (`malloc_trim`). glibc raises its mmap threshold after large frees (up to 32 MiB) and keeps
    freed blocks below it in its heap, so a freed KV pool or freed activations stay resident.
    Called where the RL loop time-slices (generator sleep / wake), not per allocation: forcing
    every allocation of 1 MiB and more through mmap instead costs a page fault per 4 KiB touched
    on every decode step (CHANGELOG has the measurement)."""
    if device_type() != "cpu" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to trim
        return
    libc.malloc_trim(0)


def send_pickled(obj: Any, group: dist.ProcessGroup, peer: int, tag: int) -> None:
    """A plain object (token ids, floats, dicts) to `peer` of `group`: its size under `tag`,
    its pickled bytes under `tag` + 1 (`recv_pickled` takes it)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], peer, tag).wait()
    group.send([data], peer, tag + 1).wait()


def recv_pickled(group: dist.ProcessGroup, peer: int, tag: int) -> Any:
    """What `send_pickled` sent from `peer` under `tag`."""
    size = torch.empty(1, dtype=torch.int64)
    group.recv([size], peer, tag).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], peer, tag + 1).wait()
    return pickle.loads(data.numpy().tobytes())

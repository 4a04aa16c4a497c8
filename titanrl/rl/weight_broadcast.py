"""New weights from the trainer ranks to the rollout ranks of an async job, in buckets.

Both sides cut the model's parameters (named_parameters order, wrappers' prefixes removed) into
the same buckets of about `rollout.weight_bucket_mb` in the generator's dtype. For each bucket the
trainer ranks gather their shards of its parameters (`full_tensor`: FSDP2 / TP / EP all-gathers,
collective over the trainer ranks), the hub casts and packs them into one flat tensor and
broadcasts it over the sync group; each rollout rank unpacks it into its generator's parameters in
place (their storage stays: compiled graphs keep pointing at it; a tp-sharded generator's rank
keeps its slice). At most one bucket of gathered
weights is alive at a time on a trainer rank, never the whole model; no tensor is pickled.
"""

from __future__ import annotations

import hashlib
import math
import time

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanrl.models.lora import clean_fqn
from titanrl.rl.async_roles import AsyncRoles, announce

Layout = list[list[tuple[str, tuple[int, ...]]]]
"""Buckets of (parameter name, shape)."""


def bucket_layout(model: nn.Module, dtype: torch.dtype, bucket_mb: float) -> Layout:
    """`model`'s parameters, in order, cut into buckets of about `bucket_mb` MB of `dtype` (a
    parameter larger than that is a bucket of its own)."""
    limit = max(1, int(bucket_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
    buckets: Layout = [[]]
    size = 0
    for name, p in model.named_parameters():
        n = math.prod(p.shape)  # a DTensor's shape is the whole parameter's
        if buckets[-1] and size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((clean_fqn(name), tuple(p.shape)))
        size += n
    return buckets if buckets[0] else []


def layout_digest(layout: Layout) -> str:
    """What both sides compare before the first broadcast: names, shapes, bucket cuts."""
    return hashlib.sha256(repr(layout).encode()).hexdigest()[:16]


@torch.no_grad()
def send_weights(model: nn.Module, version: int, r: AsyncRoles, dtype: torch.dtype, bucket_mb: float) -> float:
    """Every trainer rank: gather `model`'s weights bucket by bucket; the hub announces `version`
    and broadcasts each bucket to the rollout ranks. Returns the seconds it took."""
    began = time.perf_counter()
    layout = bucket_layout(model, dtype, bucket_mb)
    params = dict((clean_fqn(n), p) for n, p in model.named_parameters())
    if r.is_hub:
        announce(version, len(layout), r)
    for bucket in layout:
        full = [_full(params[name]) for name, _ in bucket]  # collective over the trainer ranks
        if r.is_hub:
            assert r.sync is not None, "the hub is in the sync group"
            flat = torch.cat([t.reshape(-1).to(dtype) for t in full])
            r.sync.broadcast(flat, r.num_rollout).wait()
        del full
    return time.perf_counter() - began


@torch.no_grad()
def receive_weights(model: nn.Module, num_buckets: int, r: AsyncRoles, dtype: torch.dtype, bucket_mb: float) -> None:
    """A rollout rank: take the announced weights into `model`'s parameters, in place."""
    layout = bucket_layout(model, dtype, bucket_mb)
    assert len(layout) == num_buckets, f"{num_buckets} buckets announced, {len(layout)} here (checked at start)"
    params = dict((clean_fqn(n), p) for n, p in model.named_parameters())
    device = next(model.parameters()).device
    assert r.sync is not None, "a rollout rank is in the sync group"
    for bucket in layout:
        flat = torch.empty(sum(math.prod(shape) for _, shape in bucket), dtype=dtype, device=device)
        r.sync.broadcast(flat, r.num_rollout).wait()
        offset = 0
        for name, shape in bucket:
            n = math.prod(shape)
            _load(params[name], flat[offset : offset + n].view(shape))
            offset += n


def _load(dst: torch.Tensor, full: torch.Tensor) -> None:
    """`full` into `dst`; a tp-sharded generator's DTensor takes its own slice (no communication)."""
    if isinstance(dst, DTensor):
        local = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst.to_local().copy_(local)
    else:
        dst.copy_(full)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()

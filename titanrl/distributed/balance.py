"""Token-balanced data parallelism: units of work (an RL step's groups) move between data-parallel
ranks so that each rank computes about the same number of tokens.

An RL step's reference / old logprob passes and its update cost per token, and every rank waits
for the slowest one at each collective (FSDP's gathers and reductions). With long-tailed
responses a rank that generated one long group trains several times the tokens of the others
while they wait (verl's `balance_batch` answers the same). `assign` plans, every rank computing
the same plan from the all-gathered costs; `exchange` moves pickled units with one all-to-all;
`balance_units` does both over a list of units.
"""

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def assign(costs_by_rank: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Largest first, each unit to the least-loaded rank (ties: the unit's own rank, then the
    lowest). Returns per destination rank its units as (source rank, index) pairs, sorted; with
    at least as many units as ranks, every rank gets one (costs are > 0). Nothing moves when the
    plan would not lower the most loaded rank's cost (greedy is not optimal: [3, 3] and
    [2, 2, 2] are balanced as they are, greedy makes 7 of them) or when there are fewer units
    than ranks. Deterministic: every rank computes the same plan from the same costs."""
    world = len(costs_by_rank)
    units = sorted(((-c, r, i) for r, costs in enumerate(costs_by_rank) for i, c in enumerate(costs)))
    assert all(c < 0 for c, _, _ in units), "unit costs must be positive"
    unmoved = [[(r, i) for i in range(len(costs))] for r, costs in enumerate(costs_by_rank)]
    if len(units) < world:
        return unmoved
    load = [0] * world
    plan: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for neg_cost, src, index in units:
        dest = min(range(world), key=lambda d: (load[d], d != src, d))
        plan[dest].append((src, index))
        load[dest] -= neg_cost
    return [sorted(p) for p in plan] if max(load) < max(map(sum, costs_by_rank)) else unmoved


def loads(costs_by_rank: list[list[int]], plan: list[list[tuple[int, int]]]) -> list[int]:
    """Each rank's total cost under `plan`."""
    return [sum(costs_by_rank[src][i] for src, i in units) for units in plan]


def exchange(outgoing: list[list], group: dist.ProcessGroup | None) -> list[list]:
    """`outgoing[d]`: the objects this rank sends to rank d of `group` (itself: kept, not copied).
    Returns what each rank sent to this one, by source rank. One all-to-all of pickled bytes
    (CPU tensors: gloo, also under a mixed cpu:gloo,cuda:nccl backend)."""
    me = dist.get_rank(group)
    payloads = [b"" if d == me else pickle.dumps(objs) for d, objs in enumerate(outgoing)]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    joined = b"".join(payloads)
    send = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, recv_sizes.tolist(), send_sizes.tolist(), group=group)
    chunks = recv.numpy().tobytes()
    out, offset = [], 0
    for src, size in enumerate(recv_sizes.tolist()):
        out.append(outgoing[me] if src == me else pickle.loads(chunks[offset : offset + size]))
        offset += size
    return out


@dataclass
class Balanced:
    """What `balance_units` did on this rank."""

    units: list | None
    """This rank's units after the exchange, by source rank then index; None when the plan moves
    nothing (then on every rank alike: each keeps its own)."""

    imbalance_before: float
    """The most loaded rank's cost over the mean cost per rank, before the plan."""

    imbalance: float
    """The same under the plan."""

    moved: int
    """Units the plan gives to another rank."""

    riders: list
    """Every rank's `rider`, by rank."""


def balance_units(units: list, costs: list[int], group: dist.ProcessGroup | None, rider: Any = None) -> Balanced:
    """`units` (picklable, `costs[i]` > 0 the cost of `units[i]`) spread over the ranks of `group`
    by `assign`'s plan. One all-gather of the costs, which also carries `rider` (any picklable
    value every rank wants from every other), then one `exchange` if anything moves. Collective."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (costs, rider), group=group)
    costs_by_rank = [c for c, _ in gathered]
    plan = assign(costs_by_rank)
    before = [sum(c) for c in costs_by_rank]
    mean = max(sum(before) / len(before), 1.0)
    moved = sum(src != d for d, mine in enumerate(plan) for src, _ in mine)
    received = None
    if moved:  # the same plan on every rank: all skip the exchange alike
        me = dist.get_rank(group)
        by_source = exchange([[units[i] for src, i in mine if src == me] for mine in plan], group)
        received = [u for from_rank in by_source for u in from_rank]
    return Balanced(
        received, max(before) / mean, max(loads(costs_by_rank, plan)) / mean, moved, [r for _, r in gathered]
    )

"""Sequence packing: the rows of a step batch concatenated into a few rows of fixed width.

An RL batch's rows are prompt + response, right-padded to the longest one; with long-tailed
response lengths (most short, some at the length cap) most of a padded [B, T] batch is padding.
Packing places each row's T_b - 1 inputs (the model reads tokens[:-1] and predicts tokens[1:])
into packed rows of `capacity` slots, never splitting a document (first-fit decreasing, the
capacity is the batch's padded width T - 1, so attention never costs more than in the padded
batch). Attention stays within a document (`models/attention.py`) and positions restart at 0 for
each, so every token computes what it computes in its own padded row. `PackLayout.unpack` puts
per-slot results back into the [B, T-1] layout the algorithms use: loss normalisation and the
algorithm code see the same tensors as without packing.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from tensordict import TensorDict

from titanrl.data.batch import micro_batch_plan, num_micro_batches
from titanrl.distributed.utils import all_reduce_values

# "auto" packs when the padded layout holds at least this many times the packed layout's token
# slots: per token slot, packed rows cost more (the masked attention path, the gather / scatter),
# which eats the gain below this ratio (bench_packing in docs/benchmarks.md).
AUTO_MIN_GAIN = 1.15


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's sizes summing to <= capacity: items by decreasing size
    (ties by index), each into the first bin with room, else into a new bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if sizes[i] > capacity:
            raise ValueError(f"a sequence of {sizes[i]} inputs does not fit a packed row of {capacity}")
        for j, free in enumerate(room):
            if sizes[i] <= free:
                bins[j].append(i)
                room[j] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


@dataclasses.dataclass
class PackLayout:
    """Where each input of a [B, T] batch goes in the packed [R, S] rows.

    `src_N` / `dst_N`: flat indices into [B, T-1] and [R, S] of every real input slot;
    `positions_RS`: the position of each slot in its document (0 on padding); `doc_RS`: the
    document's index within its packed row (padding at a row's end is one more document, so
    that no query attends to nothing); `spans`: per packed row, (start, end) of its documents
    and of its trailing padding."""

    B: int
    T1: int
    R: int
    S: int
    src_N: torch.Tensor
    dst_N: torch.Tensor
    positions_RS: torch.Tensor
    doc_RS: torch.Tensor
    spans: list[list[tuple[int, int]]]

    def pack(self, x_BT: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """A [B, T-1] field as [R, S], `fill` on padding slots (no gradient: inputs, masks)."""
        out = x_BT.new_full((self.R * self.S,), fill)
        out[self.dst_N.to(x_BT.device)] = x_BT.reshape(-1)[self.src_N.to(x_BT.device)]
        return out.view(self.R, self.S)

    def unpack(self, x_RS: torch.Tensor) -> torch.Tensor:
        """A per-slot result [R, S] back in [B, T-1], 0 past each row's length (differentiable)."""
        values_N = x_RS.reshape(-1)[self.dst_N.to(x_RS.device)]
        out = x_RS.new_zeros(self.B * self.T1).index_copy(0, self.src_N.to(x_RS.device), values_N)
        return out.view(self.B, self.T1)


def pack_layout(lengths: list[int], width: int, rows: list[list[int]] | None = None) -> PackLayout:
    """The layout of rows of these lengths (tokens; inputs are length - 1) from a batch padded
    to `width` tokens, packed into rows of width - 1 slots: `rows` (document indices per packed
    row, in order) or first-fit decreasing."""
    T1 = width - 1
    sizes = [n - 1 for n in lengths]
    capacity = max(T1, 1)
    rows = rows if rows is not None else first_fit_decreasing(sizes, capacity)
    docs = [b for row in rows for b in row]
    assert sorted(docs) == list(range(len(lengths))), "every document in exactly one packed row"
    n_P = torch.tensor([sizes[b] for b in docs], dtype=torch.long)
    row_P = torch.tensor([r for r, row in enumerate(rows) for _ in row], dtype=torch.long)
    offset_P = (
        torch.cat(
            [torch.tensor([0] + [sizes[b] for b in row[:-1]], dtype=torch.long).cumsum(0)[: len(row)] for row in rows]
        )
        if docs
        else torch.zeros(0, dtype=torch.long)
    )
    local_P = torch.tensor([k for row in rows for k in range(len(row))], dtype=torch.long)
    assert all(sum(sizes[b] for b in row) <= capacity for row in rows), "a packed row over capacity"
    start_N = torch.repeat_interleave(torch.cumsum(n_P, 0) - n_P, n_P)
    within_N = torch.arange(int(n_P.sum())) - start_N
    src_N = torch.repeat_interleave(torch.tensor(docs, dtype=torch.long) * T1, n_P) + within_N
    dst_N = torch.repeat_interleave(row_P * capacity + offset_P, n_P) + within_N
    R = len(rows)
    positions = torch.zeros(R * capacity, dtype=torch.long)
    positions[dst_N] = within_N
    # Padding slots: one more document per row, index len(row).
    doc = torch.tensor([len(row) for row in rows], dtype=torch.long).repeat_interleave(capacity)
    doc[dst_N] = torch.repeat_interleave(local_P, n_P)
    spans = []
    for row in rows:
        ends = torch.tensor([0] + [sizes[b] for b in row]).cumsum(0).tolist()
        tail = [(ends[-1], capacity)] if ends[-1] < capacity else []
        spans.append([(a, b) for a, b in zip(ends[:-1], ends[1:]) if b > a] + tail)
    return PackLayout(
        len(lengths), T1, R, capacity, src_N, dst_N, positions.view(R, capacity), doc.view(R, capacity), spans
    )


def packed_slots(lengths: list[int]) -> int:
    """Token slots of the packed layout of one batch of these lengths (rows x width)."""
    sizes = [n - 1 for n in lengths]
    capacity = max(max(sizes), 1)
    return len(first_fit_decreasing(sizes, capacity)) * capacity


def padded_slots(lengths: list[int], budget: int) -> int:
    """Token slots of the padded micro-batch plan (`micro_batch_plan`, sorted and cut by
    `budget`, as the trainer plans them on one rank)."""
    n = min(num_micro_batches(lengths, budget), len(lengths))
    plan = micro_batch_plan(torch.tensor(lengths), n)
    return sum(len(rows) * (max(lengths[i] for i in rows.tolist()) - 1) for rows in plan)


def use_packing(mode: str, lengths: list[int], budget: int = 0) -> bool:
    """training.packing: 'on', 'off', or 'auto' = on when the padded plan holds at least
    AUTO_MIN_GAIN times the packed layout's token slots."""
    if mode != "auto" or not lengths:
        return mode == "on" and bool(lengths)
    return padded_slots(lengths, budget) >= AUTO_MIN_GAIN * packed_slots(lengths)


def plan_packed_micro_batches(
    lengths: list[int], budget: int, dp_group: dist.ProcessGroup | None
) -> list[list[list[int]]]:
    """Micro-batches of packed rows (document indices per packed row): first-fit decreasing into
    rows of max(length) - 1 slots, then consecutive rows per micro-batch, each micro-batch at
    most `budget` slots (at least one row; 0 = one micro-batch), as many micro-batches on every
    dp rank as the rank that needs the most (collective: FSDP runs one per forward and
    backward); none when some rank has no rows. Every document lands in exactly one row."""
    sizes = [n - 1 for n in lengths]
    capacity = max(max(sizes, default=1), 1)
    rows = first_fit_decreasing(sizes, capacity)
    needed = 1 if budget <= 0 else math.ceil(len(rows) / max(budget // capacity, 1))
    most, fewest_rows = all_reduce_values([needed, -len(lengths)], dp_group, op=dist.ReduceOp.MAX)
    n = int(min(most, -fewest_rows))
    return group_rows(rows, n) if n else []


def group_rows(rows: list[list[int]], n: int) -> list[list[list[int]]]:
    """`n` non-empty micro-batches of consecutive packed rows (sizes differing by at most one);
    with fewer rows than `n` (another dp rank needs more micro-batches), the rows holding the
    most documents are halved first, then each micro-batch is one row."""
    assert 1 <= n <= sum(len(row) for row in rows), f"cannot make {n} micro-batches of {rows}"
    rows = list(rows)
    while len(rows) < n:
        i = max(range(len(rows)), key=lambda j: len(rows[j]))
        half = len(rows[i]) // 2
        rows[i : i + 1] = [rows[i][:half], rows[i][half:]]
    cuts = [len(rows) * k // n for k in range(n + 1)]
    return [rows[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def packed_micro_batches(batch: TensorDict, budget: int, dp_group: dist.ProcessGroup | None) -> list[TensorDict]:
    """`plan_packed_micro_batches` of `batch`: each micro-batch its documents (in packed-row
    order, at the batch's width, so every one fits a row) with "pack_row", the packed row of
    each, which `data.batch_forward` reads to pack them as planned."""
    out = []
    for rows in plan_packed_micro_batches(batch["length"].tolist(), budget, dp_group):
        mb = batch[torch.tensor([b for row in rows for b in row], dtype=torch.long)]
        mb["pack_row"] = torch.tensor([r for r, row in enumerate(rows) for _ in row], device=mb.device)
        out.append(mb)
    return out


def layout_of(batch: TensorDict, mode: str) -> PackLayout | None:
    """The packed layout to run `batch` in, or None for the padded rows: as planned when the
    batch carries "pack_row", else by `mode` (see `use_packing`)."""
    lengths = batch["length"].tolist()
    width = batch["tokens"].shape[1]
    if "pack_row" in batch.keys():
        rows: list[list[int]] = [[] for _ in range(int(batch["pack_row"].max()) + 1)]
        for b, r in enumerate(batch["pack_row"].tolist()):
            rows[r].append(b)
        return pack_layout(lengths, width, rows)
    return pack_layout(lengths, width) if use_packing(mode, lengths) else None

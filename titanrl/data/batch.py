"""The step batch: prompt + completion tokens and per-token fields, as one TensorDict.

Shapes: tokens [B, T] (right-padded), and for the T-1 next-token targets: loss_mask (1 on
completion tokens), gen_logprobs (the generator's logprobs), later old/ref logprobs.
"""

import torch
import torch.distributed as dist
from tensordict import TensorDict

from titanrl.distributed.utils import dp_max


def build_sequence_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    gen_logprobs: list[list[float]] | None = None,
    completion_masks: list[list[int] | None] | None = None,
) -> TensorDict:
    """Rows are prompt + completion; loss_mask marks targets that are completion tokens, times
    `completion_masks` where given (multi-turn: 0 on environment tokens)."""
    assert len(prompts) == len(completions)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    B, T = len(prompts), max(lengths)
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros(B, T - 1)
    gen_lp_BT = torch.zeros(B, T - 1)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tokens_BT[i, : len(p) + len(c)] = torch.tensor(p + c)
        # Target j is token j+1: completion tokens are targets len(p)-1 .. len(p)+len(c)-2.
        mask_BT[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0
        if gen_logprobs is not None:
            gen_lp_BT[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(gen_logprobs[i])
        completion_mask = completion_masks[i] if completion_masks is not None else None
        if completion_mask is not None:
            assert len(completion_mask) == len(c), "one mask entry per completion token"
            mask_BT[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(completion_mask, dtype=mask_BT.dtype)
    return TensorDict(
        {"tokens": tokens_BT, "loss_mask": mask_BT, "gen_logprobs": gen_lp_BT, "length": torch.tensor(lengths)},
        batch_size=[B],
    )


def split_batch(batch: TensorDict, num_chunks: int) -> list[TensorDict]:
    """Consecutive chunks of rows (for mini-batches or micro-batches), padding trimmed per chunk."""
    B = batch.batch_size[0]
    if num_chunks < 1 or B % num_chunks:
        raise ValueError(f"{B} sequences cannot be split into {num_chunks} equal chunks")
    return [trim_padding(chunk) for chunk in batch.split(B // num_chunks)]


def trim_padding(batch: TensorDict) -> TensorDict:
    T = int(batch["length"].max())
    out = batch.clone()
    out["tokens"] = batch["tokens"][:, :T]
    # Every other [B, T-1, ...] field is per next-token target (masks, logprobs, values,
    # advantages) or per input (MoE routes).
    for key in batch.keys():
        if key != "tokens" and batch[key].dim() >= 2:
            out[key] = batch[key][:, : T - 1]
    return out


def num_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """Micro-batches this rank needs so that each holds about `max_tokens` padded tokens, for
    sequences of these lengths."""
    if max_tokens <= 0:
        return 1
    lengths = sorted(lengths)
    count, rows, longest = 1, 0, 0
    for length in lengths:
        if rows and max(longest, length) * (rows + 1) > max_tokens:
            count, rows, longest = count + 1, 0, 0
        rows, longest = rows + 1, max(longest, length)
    return count


def micro_batch_plan(lengths_B: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """Row indices of `num_chunks` micro-batches: rows sorted by length (less padding), cut at
    about equal token counts, none empty. Every row lands in exactly one of them."""
    B = lengths_B.shape[0]
    assert 1 <= num_chunks <= B, f"cannot split {B} rows into {num_chunks} micro-batches"
    order = torch.argsort(lengths_B, stable=True)
    cum = torch.cumsum(lengths_B[order].float(), 0)
    bounds, start = [], 0
    for k in range(1, num_chunks):
        # First row past the k-th token quantile, keeping every chunk non-empty.
        target = cum[-1] * k / num_chunks
        end = int(torch.searchsorted(cum, target).item()) + 1
        end = min(max(end, start + 1), B - (num_chunks - k))
        bounds.append((start, end))
        start = end
    bounds.append((start, B))
    return [order[a:b] for a, b in bounds]


def micro_batches(batch: TensorDict, num_chunks: int) -> list[TensorDict]:
    """`micro_batch_plan`'s micro-batches of `batch`, padding trimmed per micro-batch."""
    return [trim_padding(batch[rows]) for rows in micro_batch_plan(batch["length"], num_chunks)]


def plan_micro_batches(
    lengths: list[int], micro_batch_tokens: int, dp_group: dist.ProcessGroup | None, sort_single: bool = False
) -> list[torch.Tensor]:
    """Row indices of this rank's micro-batches: each about `micro_batch_tokens` padded tokens
    (`lengths` = padded tokens per row), as many on every rank of `dp_group` (FSDP runs
    collectives in every forward and backward); none when some rank has no rows. A single
    micro-batch keeps the rows in order unless `sort_single` (order changes the sums' rounding)."""
    needed = num_micro_batches(lengths, micro_batch_tokens)
    most, fewest_rows = dp_max([needed, -len(lengths)], dp_group)
    n = int(min(most, -fewest_rows))
    if n == 0:
        return []
    if n == 1 and not sort_single:
        return [torch.arange(len(lengths))]
    return micro_batch_plan(torch.tensor(lengths), n)

"""Context parallelism: every row of a batch split over the `cp` ranks of a group.

Sharding (causal load balance): a row of S slots is padded to a multiple of 2 x cp and cut into
2 x cp chunks; cp rank r holds chunks r and 2cp - 1 - r, so that under a causal mask every rank
has the same number of (query, key) pairs to compute. Positions and document ids (packed rows:
both restart per document) are carried per slot, so a shard knows where its tokens sit.

Attention across shards is Llama 3's all-gather CP: each layer all-gathers the keys and values
of the row over cp and every rank attends its own queries to them with the causal + document
mask computed from global slot indices. Chosen over ring attention and torch's
`context_parallel` because it is one collective per layer that gloo implements (the tests run
on CPU), it takes any mask (packed documents), and its backward is a plain sum of the key/value
gradients; the price is O(T) keys and values per rank while every other activation is O(T / cp).
The mask is built per block of queries and never kept whole (`CPAttention`).
torch's `context_parallel` is built on CUDA SDPA kernels (flash / efficient / cuDNN) with a
causal mask only, so it runs neither on CPU nor on packed rows.

Gradients: the key/value gather's backward sums every rank's key/value gradients and keeps this
rank's shard. Per-token results (logprobs, entropy, values) are gathered back to the whole row
after the chunked vocabulary projection (hidden states stay sharded, no [T, V]); every cp rank
then computes the same loss, so the backward of that gather keeps this rank's slice of the
(identical) gradient with no communication. FSDP2 sums parameter gradients over dp_shard x cp,
which adds the shards' contributions: the gradient of the whole sequence.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanrl.config.job_config import JobConfig

# Queries per attention call: the mask of one call is QUERY_BLOCK x T booleans.
QUERY_BLOCK = 512

# Document id of the slots that pad a row to a multiple of 2 x cp: a document of their own, so no
# real token sees them and each of them sees at least itself.
PAD_DOC = -1


@dataclasses.dataclass
class CPShard:
    """Where this cp rank's slots sit in a row of `S` slots padded to `S_pad`.

    `index_L`: this rank's slot indices (head chunk, then tail chunk); `order_P`: the slot index
    of each position of a gathered row (rank 0's shard, rank 1's, ...)."""

    group: dist.ProcessGroup | None
    cp: int
    rank: int
    S: int
    S_pad: int
    index_L: torch.Tensor
    order_P: torch.Tensor

    def shard(self, x_RS: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """This rank's slots [R, L, ...] of a per-slot field [R, S, ...] (`fill` on the padding)."""
        if self.S_pad > self.S:
            pad_shape = (x_RS.shape[0], self.S_pad - self.S, *x_RS.shape[2:])
            x_RS = torch.cat([x_RS, x_RS.new_full(pad_shape, fill)], dim=1)
        return x_RS[:, self.index_L.to(x_RS.device)]

    def unshard(self, x_RL: torch.Tensor) -> torch.Tensor:
        """The whole row [R, S, ...] from every rank's [R, L, ...] (differentiable; every rank
        must compute the same function of the result: the backward keeps this rank's slice)."""
        gathered_RP = GatherSeq.apply(x_RL, self.group, self.cp, self.rank, False)
        out_RS = torch.empty_like(gathered_RP)
        out_RS[:, self.order_P.to(x_RL.device)] = gathered_RP
        return out_RS[:, : self.S]

    def gather_kv(self, x_BLHD: torch.Tensor) -> torch.Tensor:
        """Keys or values of the whole row, in gathered order [B, cp * L, H, D]; the backward sums
        the gradients of every rank's queries."""
        return GatherSeq.apply(x_BLHD, self.group, self.cp, self.rank, True)


def shard_plan(S: int, cp: int, rank: int, group: dist.ProcessGroup | None = None) -> CPShard:
    """The load-balanced split of rows of `S` slots over `cp` ranks, for `rank`."""
    chunk = -(-S // (2 * cp))
    S_pad = chunk * 2 * cp

    def slots(r: int) -> torch.Tensor:
        head = torch.arange(r * chunk, (r + 1) * chunk)
        tail = torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
        return torch.cat([head, tail])

    order_P = torch.cat([slots(r) for r in range(cp)])
    return CPShard(group, cp, rank, S, S_pad, slots(rank), order_P)


class GatherSeq(torch.autograd.Function):
    """All-gather along dim 1 over the cp group. Backward: `sum_grads` adds every rank's gradient
    (keys / values: each rank's queries contribute) before keeping this rank's slice; without it
    the gradient is the same on every rank (a replicated loss) and the slice is taken as is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, cp: int, rank: int, sum_grads: bool) -> torch.Tensor:
        ctx.group, ctx.cp, ctx.rank, ctx.sum_grads, ctx.L = group, cp, rank, sum_grads, x.shape[1]
        if cp == 1:
            return x.clone()
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_grads and ctx.cp > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        L = ctx.L
        return grad[:, ctx.rank * L : (ctx.rank + 1) * L].contiguous(), None, None, None, None


class CPAttention:
    """An `AttentionBackend` over this rank's slots: keys and values all-gathered over cp, the
    mask causal within each document by global slot index (`doc_RS`: the whole rows' document
    ids, one per slot).

    Queries go in blocks of `QUERY_BLOCK`, each block's [block, T] mask built inside a
    checkpoint, so no [T / cp, T] mask is ever kept: a block's mask lives while its attention
    runs (forward, and again in backward), and what backward keeps is O(T) per layer."""

    def __init__(self, plan: CPShard, doc_RS: torch.Tensor) -> None:
        self.plan = plan
        self.q_L, self.k_P = plan.index_L.to(doc_RS.device), plan.order_P.to(doc_RS.device)
        self.doc_RP = _padded(doc_RS, plan)[:, self.k_P]
        self.doc_RL = plan.shard(doc_RS, PAD_DOC)

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        k_BPHD, v_BPHD = self.plan.gather_kv(k_BTHD), self.plan.gather_kv(v_BTHD)
        L = q_BTHD.shape[1]
        if L <= QUERY_BLOCK:
            return self._block(q_BTHD, k_BPHD, v_BPHD, 0)
        outs = [
            checkpoint(self._block, q_BTHD[:, a : a + QUERY_BLOCK], k_BPHD, v_BPHD, a, use_reentrant=False)
            for a in range(0, L, QUERY_BLOCK)
        ]
        return torch.cat(outs, dim=1)

    def _block(self, q_BNHD: torch.Tensor, k_BPHD: torch.Tensor, v_BPHD: torch.Tensor, start: int) -> torch.Tensor:
        n = q_BNHD.shape[1]
        q_N = self.q_L[start : start + n]
        same_doc_RNP = self.doc_RL[:, start : start + n, None] == self.doc_RP[:, None, :]
        mask_R1NP = (same_doc_RNP & (self.k_P[None, :] <= q_N[:, None]))[:, None]
        return F.scaled_dot_product_attention(
            q_BNHD.transpose(1, 2),
            k_BPHD.transpose(1, 2),
            v_BPHD.transpose(1, 2),
            attn_mask=mask_R1NP,
            enable_gqa=q_BNHD.shape[2] != k_BPHD.shape[2],
        ).transpose(1, 2)


def check_same_rows(inputs_RS: torch.Tensor, plan: CPShard) -> None:
    """The cp ranks of a group must hold the same rows (same batch, each its shard): a checksum
    compared over cp (one small all-reduce), so that ranks that diverged (say, rollouts sampled
    differently) stop with an error instead of training on a mix of two batches."""
    if plan.cp == 1:
        return
    x = inputs_RS.to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device).view_as(x)
    sums = torch.stack([x.sum(), (x * weights).sum(), torch.tensor(float(x.numel()), device=x.device)])
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=plan.group)
    if not torch.equal(both[:3], -both[3:]):
        raise RuntimeError(
            "context parallelism: the cp ranks of a group hold different batches; they must see the same "
            "rows (same data shard, same rollouts): check that data loading and sampling do not depend on the cp rank"
        )


def _padded(x_RS: torch.Tensor, plan: CPShard) -> torch.Tensor:
    if plan.S_pad == plan.S:
        return x_RS
    return torch.cat([x_RS, x_RS.new_full((x_RS.shape[0], plan.S_pad - plan.S), PAD_DOC)], dim=1)


def validate_cp(config: JobConfig, cp: int, moe: bool) -> None:
    """What context parallelism does not support yet, as one-line errors naming the key."""
    if cp == 1:
        return
    unsupported = {
        "compile.enable = true": config.compile.enable,
        "generator.batch_invariant = true": config.generator.batch_invariant,
        f"job.recipe = '{config.job.recipe}'": config.job.recipe not in ("rl", "sft"),
        "a mixture-of-experts model": moe,
        "distillation": bool(config.distillation.teacher_hf_checkpoint),
    }
    for what, active in unsupported.items():
        if active:
            raise ValueError(
                f"[parallelism] cp = {cp} does not support {what} yet; set cp = 1 or turn that off "
                "(docs/context_parallel.md)"
            )

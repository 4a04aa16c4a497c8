"""Token logprobs and entropy of a language model, with or without [B, T, vocab] logits.

`token_logprobs` takes logits (the generator's sampled rows, small). `chunked_token_logprobs`
takes the final hidden states and the output weight and never holds more than one chunk of
logits: forward computes each chunk's logits, keeps the target's logprob (and the entropy), and
drops the chunk; backward recomputes each chunk's logits and turns them into gradients for the
hidden states and the weight (the idea of Liger-Kernel's fused linear cross entropy). Memory for
logits is chunk_tokens x vocab floats instead of B x T x vocab (x 3 or more with autograd's copies).

Each row goes through the same ops as `token_logprobs(linear(h, W))` (linear, float, log_softmax,
gather), so in batch-invariant mode the trainer's logprobs are bitwise the generator's.

Under tensor parallelism the output weight is vocab-sharded (a DTensor, Shard(0) on the tp mesh)
and `vocab_parallel_token_logprobs` never gathers logits either: each rank projects the full
(replicated) hidden rows onto its vocab shard, chunk by chunk, and the log-sum-exp over the whole
vocabulary comes from an all-reduce MAX and one all-reduce SUM of two numbers per row (sum of exp,
target logit; a third, sum of exp * logit, for the entropy): Megatron's vocab-parallel cross
entropy, chunked. Backward keeps only the per-row log-sum-exp.
"""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in float32 at least (bf16 / fp16 logits lose too much), float64 kept (references)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def logprobs_and_entropy(
    logits_XV: torch.Tensor, targets_X: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one formula for logits of any leading shape X: log p(target) in float32 (float64 for
    float64 logits), and the entropy (a statistic: no gradient) or None."""
    logp_XV = torch.log_softmax(_upcast(logits_XV), dim=-1)
    logprobs_X = logp_XV.gather(-1, targets_X.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs_X, None
    with torch.no_grad():  # in place on p: one [X, V] buffer fewer at the peak
        p_XV = logp_XV.exp()
        entropy_X = -p_XV.mul_(logp_XV).sum(-1)
    return logprobs_X, entropy_X


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, in float32 (float64 for float64 logits): [B, T]."""
    return logprobs_and_entropy(logits_BTV, targets_BT, with_entropy=False)[0]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(logprobs [N], entropy [N] or empty) of `targets_N` from hidden states [N, D] and the
    output weight [V, D], `chunk` rows of logits at a time; gradients flow from the logprobs only
    (the entropy is a statistic)."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, chunk: int, with_entropy: bool):
        logprobs, entropies = [], []
        for h_CD, t_C in zip(h_ND.split(chunk), targets_N.split(chunk)):
            logprobs_C, entropy_C = logprobs_and_entropy(F.linear(h_CD, weight_VD), t_C, with_entropy)
            logprobs.append(logprobs_C)
            if with_entropy:
                assert entropy_C is not None
                entropies.append(entropy_C)
        ctx.save_for_backward(h_ND, weight_VD, targets_N)
        ctx.chunk = chunk
        entropy_N = torch.cat(entropies) if with_entropy else h_ND.new_empty(0)
        ctx.mark_non_differentiable(entropy_N)
        return torch.cat(logprobs), entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy):
        h_ND, weight_VD, targets_N = ctx.saved_tensors

        def grad_logits():
            for h_CD, t_C, g_C in zip(
                h_ND.split(ctx.chunk), targets_N.split(ctx.chunk), grad_logprobs_N.split(ctx.chunk)
            ):
                # d log_softmax(z)_t / dz = onehot(t) - softmax(z), times the incoming gradient.
                probs_CV = torch.softmax(_upcast(F.linear(h_CD, weight_VD)), dim=-1)
                grad_logits_CV = probs_CV.mul_(-g_C[:, None])
                yield grad_logits_CV.scatter_add_(1, t_C[:, None], g_C[:, None])

        grad_h, grad_w = linear_backward(ctx.needs_input_grad, h_ND, weight_VD, ctx.chunk, grad_logits())
        return grad_h, grad_w, None, None, None


def linear_backward(
    needs_input_grad: tuple[bool, ...], h_ND: torch.Tensor, weight_VD: torch.Tensor, chunk: int, grad_logits_chunks
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad h, grad W) of logits = h W^T from each chunk's grad logits [C, V], in the order of
    `h_ND.split(chunk)` (a generator: one chunk's logits live at a time), for the inputs that
    need them; grad W accumulates in place in float32 at least (no [V, D] temporary per chunk)."""
    grad_h = torch.empty_like(h_ND) if needs_input_grad[0] else None
    grad_w = (
        torch.zeros_like(weight_VD, dtype=torch.promote_types(weight_VD.dtype, torch.float32))
        if needs_input_grad[1]
        else None
    )
    start = 0
    for h_CD, grad_logits_CV in zip(h_ND.split(chunk), grad_logits_chunks):
        grad_logits_CV = grad_logits_CV.to(h_ND.dtype)
        if grad_h is not None:
            grad_h[start : start + len(h_CD)] = grad_logits_CV @ weight_VD
        if grad_w is not None:
            grad_w.addmm_(grad_logits_CV.t().to(grad_w.dtype), h_CD.to(grad_w.dtype))
        start += len(h_CD)
    return grad_h, grad_w.to(weight_VD.dtype) if grad_w is not None else None


def chunked_token_logprobs(
    h_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_BT: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
    mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [B, T] in float32 (float64 for float64 inputs), entropy [B, T] or None) from
    the final hidden states and the output weight, `chunk_tokens` positions of logits at a time.

    With `mask_BT`, only the positions where it is non-zero are projected to the vocabulary (an RL
    batch's prompt tokens are most of its positions and need no logprob); the others are 0."""
    h_ND, targets_N = _select_rows(h_BTD, targets_BT, mask_BT)
    logprobs_N, entropy_N = _ChunkedTokenLogprobs.apply(h_ND, weight_VD, targets_N, chunk_tokens, with_entropy)
    return _scatter_rows(logprobs_N, entropy_N if with_entropy else None, mask_BT, h_BTD.shape[:2])


def _select_rows(
    h_BTD: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows to project, [N, D] and [N]: every position, or those where `mask_BT` is non-zero."""
    if mask_BT is None:
        return h_BTD.reshape(-1, h_BTD.shape[-1]), targets_BT.reshape(-1)
    rows_BT = mask_BT != 0
    return h_BTD[rows_BT], targets_BT[rows_BT]


def _scatter_rows(
    logprobs_N: torch.Tensor, entropy_N: torch.Tensor | None, mask_BT: torch.Tensor | None, BT: torch.Size
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of `_select_rows` back to [B, T], 0 where the mask is 0."""
    B, T = BT
    if mask_BT is None:
        return logprobs_N.view(B, T), entropy_N.view(B, T) if entropy_N is not None else None
    rows_BT = mask_BT != 0
    logprobs_BT = logprobs_N.new_zeros(B, T).masked_scatter(rows_BT, logprobs_N)
    entropy_BT = entropy_N.new_zeros(B, T).masked_scatter(rows_BT, entropy_N) if entropy_N is not None else None
    return logprobs_BT, entropy_BT


def _local_target_logit(
    z_CV: torch.Tensor, t_C: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the target's logit where this rank's vocab shard holds the target id, else 0; the column
    of the target in the shard, clamped in range; whether the shard holds it) per row."""
    t_local_C = t_C - vocab_start
    owned_C = (t_local_C >= 0) & (t_local_C < z_CV.shape[1])
    col_C = t_local_C.clamp(0, z_CV.shape[1] - 1)
    z_t_C = z_CV.gather(1, col_C[:, None]).squeeze(1)
    return torch.where(owned_C, z_t_C, torch.zeros_like(z_t_C)), col_C, owned_C


class _VocabParallelChunkedLogprobs(torch.autograd.Function):
    """`_ChunkedTokenLogprobs` with the weight's rows split over the ranks of `mesh` (1-D): this
    rank holds vocab ids [vocab_start, vocab_start + Vl) as `weight_VlD` and every row of
    `h_ND` (the same rows on every rank). Outputs are the same on every rank.

    The gradient of `h_ND` is this rank's partial sum (its vocab shard's share): the caller sums
    it over `mesh` (`vocab_parallel_token_logprobs` does it through DTensor's autograd).
    The gradient of `weight_VlD` is complete: only this rank's vocab rows touch its shard."""

    @staticmethod
    def forward(ctx, h_ND, weight_VlD, targets_N, chunk: int, with_entropy: bool, mesh: DeviceMesh, vocab_start: int):
        logprobs, entropies, lses = [], [], []
        for h_CD, t_C in zip(h_ND.split(chunk), targets_N.split(chunk)):
            z_CV = _upcast(F.linear(h_CD, weight_VlD))
            max_C = funcol.all_reduce(z_CV.max(dim=1).values, "max", mesh)
            s_CV = z_CV - max_C[:, None]  # <= 0 on every rank: exp cannot overflow
            e_CV = s_CV.exp()
            # Sum over the vocabulary of exp(s), s at the target (one rank owns it, the others
            # add 0) and, for the entropy, exp(s) * s: one all-reduce for the three.
            parts = [e_CV.sum(1), _local_target_logit(s_CV, t_C, vocab_start)[0]]
            if with_entropy:
                parts.append((e_CV * s_CV).sum(1))
            sums_KC = funcol.all_reduce(torch.stack(parts), "sum", mesh)
            log_sumexp_C = sums_KC[0].log()
            logprobs.append(sums_KC[1] - log_sumexp_C)
            lses.append(max_C + log_sumexp_C)
            if with_entropy:
                # H = -sum p log p with log p = s - log_sumexp: no max to cancel.
                entropies.append(log_sumexp_C - sums_KC[2] / sums_KC[0])
        # split gives at least one (maybe empty) chunk: the cats are never of an empty list.
        ctx.save_for_backward(h_ND, weight_VlD, targets_N, torch.cat(lses))
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        entropy_N = torch.cat(entropies) if with_entropy else h_ND.new_empty(0)
        ctx.mark_non_differentiable(entropy_N)
        return torch.cat(logprobs), entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy):
        h_ND, weight_VlD, targets_N, lse_N = ctx.saved_tensors

        def grad_logits():
            chunks = [x.split(ctx.chunk) for x in (h_ND, targets_N, grad_logprobs_N, lse_N)]
            for h_CD, t_C, g_C, lse_C in zip(*chunks):
                # d logprob / dz = onehot(t) - softmax(z); the softmax from the saved global lse.
                z_CV = _upcast(F.linear(h_CD, weight_VlD))
                grad_logits_CV = torch.exp(z_CV - lse_C[:, None]).mul_(-g_C[:, None])
                _, col_C, owned_C = _local_target_logit(z_CV, t_C, ctx.vocab_start)
                owned_g_C = torch.where(owned_C, g_C, torch.zeros_like(g_C))
                yield grad_logits_CV.scatter_add_(1, col_C[:, None], owned_g_C[:, None])

        grad_h, grad_w = linear_backward(ctx.needs_input_grad, h_ND, weight_VlD, ctx.chunk, grad_logits())
        return grad_h, grad_w, None, None, None, None, None


def vocab_parallel_token_logprobs(
    h_BTD: torch.Tensor,
    weight_VD: DTensor,
    targets_BT: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = False,
    mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunked_token_logprobs` for a vocab-sharded output weight (a DTensor, Shard(0) on a 1-D tp
    mesh, as TP's ColwiseParallel leaves it), without gathering logits. Returns plain tensors,
    the same on every tp rank.

    `h_BTD` is a DTensor on that mesh (sequence-sharded with sequence parallelism, or replicated)
    or a plain tensor holding the same values on every tp rank. Its rows are all-gathered (a
    replicated DTensor turned local with Partial gradients: DTensor's autograd sums the ranks'
    shares of grad h, a reduce-scatter back to Shard(1)); the weight's local shard gets its
    gradient back as the Shard(0) DTensor it came from."""
    mesh = weight_VD.device_mesh
    assert mesh.ndim == 1 and tuple(weight_VD.placements) == (Shard(0),), (mesh, weight_VD.placements)
    weight_VlD = weight_VD.to_local()
    assert weight_VlD.shape[0] * mesh.size() == weight_VD.shape[0], "vocab must split evenly over tp"
    if not isinstance(h_BTD, DTensor):
        h_BTD = DTensor.from_local(h_BTD, mesh, [Replicate()], run_check=False)
    assert h_BTD.device_mesh == mesh, (h_BTD.device_mesh, mesh)
    h_BTD = h_BTD.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    h_ND, targets_N = _select_rows(h_BTD, targets_BT, mask_BT)
    vocab_start = mesh.get_local_rank() * weight_VlD.shape[0]
    logprobs_N, entropy_N = _VocabParallelChunkedLogprobs.apply(
        h_ND, weight_VlD, targets_N, chunk_tokens, with_entropy, mesh, vocab_start
    )
    return _scatter_rows(logprobs_N, entropy_N if with_entropy else None, mask_BT, h_BTD.shape[:2])

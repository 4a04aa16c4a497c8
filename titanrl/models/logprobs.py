"""Token logprobs and entropy of a language model, with or without [B, T, vocab] logits.

`token_logprobs` takes logits (the generator's sampled rows, small). `chunked_token_logprobs`
takes the final hidden states and the output weight and never holds more than one chunk of
logits: forward computes each chunk's logits, keeps the target's logprob (and the entropy), and
drops the chunk; backward recomputes each chunk's logits and turns them into gradients for the
hidden states and the weight (the idea of Liger-Kernel's fused linear cross entropy). Memory for
logits is chunk_tokens x vocab floats instead of B x T x vocab (x 3 or more with autograd's copies).

Each row goes through the same ops as `token_logprobs(linear(h, W))` (linear, float, log_softmax,
gather), so in batch-invariant mode the trainer's logprobs are bitwise the generator's.
"""

import torch
import torch.nn.functional as F


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in float32 at least (bf16 / fp16 logits lose too much), float64 kept (references)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def logprobs_and_entropy(logits_XV: torch.Tensor, targets_X: torch.Tensor, with_entropy: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one formula for logits of any leading shape X: log p(target) in float32 (float64 for
    float64 logits), and the entropy (a statistic: no gradient) or None."""
    logp_XV = torch.log_softmax(_upcast(logits_XV), dim=-1)
    logprobs_X = logp_XV.gather(-1, targets_X.unsqueeze(-1)).squeeze(-1)
    entropy_X = -(logp_XV.exp() * logp_XV).sum(-1).detach() if with_entropy else None
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
                entropies.append(entropy_C)
        ctx.save_for_backward(h_ND, weight_VD, targets_N)
        ctx.chunk = chunk
        entropy_N = torch.cat(entropies) if with_entropy else h_ND.new_empty(0)
        ctx.mark_non_differentiable(entropy_N)
        return torch.cat(logprobs), entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, _grad_entropy):
        h_ND, weight_VD, targets_N = ctx.saved_tensors
        grad_h = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight_VD, dtype=torch.promote_types(weight_VD.dtype, torch.float32)) if ctx.needs_input_grad[1] else None
        start = 0
        for h_CD, t_C, g_C in zip(h_ND.split(ctx.chunk), targets_N.split(ctx.chunk), grad_logprobs_N.split(ctx.chunk)):
            # d log_softmax(z)_t / dz = onehot(t) - softmax(z), times the incoming gradient.
            probs_CV = torch.softmax(_upcast(F.linear(h_CD, weight_VD)), dim=-1)
            grad_logits_CV = probs_CV.mul_(-g_C[:, None])
            grad_logits_CV.scatter_add_(1, t_C[:, None], g_C[:, None])
            grad_logits_CV = grad_logits_CV.to(h_ND.dtype)
            if grad_h is not None:
                grad_h[start : start + len(h_CD)] = grad_logits_CV @ weight_VD
            if grad_w is not None:
                grad_w += grad_logits_CV.t().to(grad_w.dtype) @ h_CD.to(grad_w.dtype)
            start += len(h_CD)
        return grad_h, grad_w.to(weight_VD.dtype) if grad_w is not None else None, None, None, None


def chunked_token_logprobs(
    h_BTD: torch.Tensor, weight_VD: torch.Tensor, targets_BT: torch.Tensor, chunk_tokens: int,
    with_entropy: bool = False, mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [B, T] in float32 (float64 for float64 inputs), entropy [B, T] or None) from
    the final hidden states and the output weight, `chunk_tokens` positions of logits at a time.

    With `mask_BT`, only the positions where it is non-zero are projected to the vocabulary (an RL
    batch's prompt tokens are most of its positions and need no logprob); the others are 0."""
    B, T, D = h_BTD.shape
    if mask_BT is None:
        h_ND, targets_N = h_BTD.reshape(B * T, D), targets_BT.reshape(B * T)
    else:
        rows_BT = mask_BT != 0
        h_ND, targets_N = h_BTD[rows_BT], targets_BT[rows_BT]
    logprobs_N, entropy_N = _ChunkedTokenLogprobs.apply(h_ND, weight_VD, targets_N, chunk_tokens, with_entropy)
    if mask_BT is None:
        return logprobs_N.view(B, T), entropy_N.view(B, T) if with_entropy else None
    logprobs_BT = logprobs_N.new_zeros(B, T).masked_scatter(rows_BT, logprobs_N)
    entropy_BT = entropy_N.new_zeros(B, T).masked_scatter(rows_BT, entropy_N) if with_entropy else None
    return logprobs_BT, entropy_BT

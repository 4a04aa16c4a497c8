"""Pieces shared by policy-gradient losses: KL estimators, clipped ratio, aggregation, entropy.

Aggregation divides by *global* counts (summed over data-parallel ranks and micro-batches)
that the caller passes in, so the gradient is the same however a batch is split.
"""

from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def kl_estimate(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): k1 = log r', k2 = (log r')^2 / 2, k3 = r - 1 - log r, with
    log r' = logp - logp_ref and r = pi_ref / pi. k3 is unbiased and non-negative."""
    log_ratio = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}'; choose k1, k2 or k3")


def clipped_surrogate(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective as a loss: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    Returns (loss_BT, clipped_BT) where clipped marks tokens whose clipped term was chosen.
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped = -advantages_BT * ratio_BT
    clipped = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, agg: LossAgg, num_global_tokens: float, num_global_seqs: float
) -> torch.Tensor:
    """Reduce per-token losses to the local share of the global loss.

    token-mean: sum over all tokens / global token count (DAPO's token-level loss).
    seq-mean-token-mean: mean over each sequence's tokens, then / global sequence count (GRPO).
    seq-mean-token-sum: sum over each sequence's tokens, then / global sequence count (Dr.GRPO,
    whose constant length normaliser is absorbed in the learning rate).
    """
    masked = loss_BT * mask_BT
    if agg == "token-mean":
        return masked.sum() / num_global_tokens
    per_seq = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / mask_BT.sum(-1).clamp(min=1.0)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation '{agg}'")
    return per_seq.sum() / num_global_seqs


@torch.no_grad()
def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the softmax policy [B, T]."""
    logp = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)

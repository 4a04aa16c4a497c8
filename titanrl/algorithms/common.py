"""Pieces shared by policy-gradient algorithms: KL estimators, the clipped surrogate loss,
aggregation, masked whitening, token-level rewards, off-policy importance weights.

Aggregation divides by *global* counts (summed over data-parallel ranks and micro-batches)
that the caller passes in, so the gradient is the same however a batch is split.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

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


def per_token(advantages: torch.Tensor, like_BT: torch.Tensor) -> torch.Tensor:
    """Advantages per sequence [B] broadcast over the tokens of `like_BT`; per token [B, T] as they are."""
    return advantages[:, None].expand_as(like_BT) if advantages.dim() == 1 else advantages


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


def masked_whiten(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, dp_group: dist.ProcessGroup | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the *global* batch (summed over `dp_group`),
    zero outside the mask. std is the population std (as OpenRLHF/verl whiten)."""
    stats = torch.stack([(values_BT * mask_BT).sum(), (values_BT**2 * mask_BT).sum(), mask_BT.sum()]).double()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stats, group=dp_group)
    total, total_sq, count = stats.tolist()
    count = max(count, 1.0)
    mean = total / count
    var = max(total_sq / count - mean**2, 0.0)
    return (values_BT - mean) / (var**0.5 + eps) * mask_BT


def token_rewards(
    scores_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_scores: list[list[float]] | None = None,
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL_t on every completion token, plus the sequence's score on
    its last completion token (the token-level KL-in-reward of PPO / REINFORCE++).

    Multi-turn: with `turn_scores` (a list of per-turn rewards per row, non-empty), reward k of a
    row goes on the last token of its k-th model turn (the k-th run of 1s in the mask; surplus
    rewards go on the last turn) instead of `scores_B`.
    """
    rewards_BT = torch.zeros_like(mask_BT, dtype=torch.float32)
    if kl_BT is not None and kl_coef > 0:
        rewards_BT = rewards_BT - kl_coef * kl_BT * mask_BT
    if turn_scores is not None:
        on = (mask_BT > 0).tolist()
        for b, scores in enumerate(turn_scores):
            ends = [t for t in range(len(on[b])) if on[b][t] and (t + 1 == len(on[b]) or not on[b][t + 1])]
            for k, score in enumerate(scores if ends else []):
                rewards_BT[b, ends[min(k, len(ends) - 1)]] += score
        return rewards_BT
    positions = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT > 0, positions, -1).max(dim=1).values
    has_tokens = last_B >= 0
    rows = torch.arange(mask_BT.shape[0], device=mask_BT.device)[has_tokens]
    rewards_BT[rows, last_B[has_tokens]] += scores_B.to(rewards_BT.dtype)[has_tokens]
    return rewards_BT


OffPolicyCorrection = Literal["none", "tis", "mis"]


def importance_weights(
    old_logprobs_BT: torch.Tensor, gen_logprobs_BT: torch.Tensor, mode: OffPolicyCorrection, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights that correct for the generator sampling from pi_gen while the loss assumes the
    trainer's pi_old, w_t = pi_old(y_t) / pi_gen(y_t), with no gradient:

      tis (truncated IS; Yao et al., "Your efficient RL framework secretly brings you off-policy
           RL training", 2025): w_t = min(w_t, C)
      mis (masked IS; Liu et al., "When speed kills stability", 2025): w_t if 1/C <= w_t <= C,
           else 0, i.e. the token is dropped from the loss.

    Returns (weights_BT, dropped_BT) where dropped marks tokens truncated (tis) or masked (mis).
    """
    ratio_BT = torch.exp(old_logprobs_BT.detach() - gen_logprobs_BT)
    if mode == "none":
        return torch.ones_like(ratio_BT), torch.zeros_like(ratio_BT, dtype=torch.bool)
    if mode == "tis":
        dropped = ratio_BT > cap
        return ratio_BT.clamp(max=cap), dropped
    if mode == "mis":
        dropped = (ratio_BT > cap) | (ratio_BT < 1.0 / cap)
        return torch.where(dropped, 0.0, ratio_BT), dropped
    raise ValueError(f"unknown off-policy correction '{mode}'; choose none, tis or mis")


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Local share of the global loss (sum over ranks/micro-batches is the full loss)."""
    policy_loss_sum: torch.Tensor
    kl_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_max: torch.Tensor


def clipped_pg_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: LossAgg,
    num_global_tokens: float,
    num_global_seqs: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights_BT: torch.Tensor | None = None,
) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), shared by GRPO, Dr.GRPO,
    DAPO, RLOO, ReMax, REINFORCE++ and PPO, which differ only in their advantages:

        L_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) + beta * KL_t,
        r_t = pi(y_t) / pi_old(y_t),

    `advantages` is per sequence [B] or per token [B, T]; w_t are off-policy importance weights
    (`importance_weights`, 1 when None); KL_t one of k1/k2/k3 to the reference policy.
    """
    advantages_BT = per_token(advantages, logprobs_BT)
    pg_BT, clipped_BT = clipped_surrogate(logprobs_BT, old_logprobs_BT, advantages_BT, clip_low, clip_high)
    return _finish(
        pg_BT,
        clipped_BT,
        logprobs_BT,
        old_logprobs_BT,
        mask_BT,
        loss_agg,
        num_global_tokens,
        num_global_seqs,
        ref_logprobs_BT,
        kl_coef,
        kl_estimator,
        is_weights_BT,
    )


def _finish(
    pg_BT,
    clipped_BT,
    logprobs_BT,
    old_logprobs_BT,
    mask_BT,
    loss_agg,
    num_global_tokens,
    num_global_seqs,
    ref_logprobs_BT,
    kl_coef,
    kl_estimator,
    is_weights_BT,
) -> LossOutput:
    """Weigh the policy term by the off-policy importance weights (when given), add the KL term,
    aggregate, and collect the statistics every policy loss reports."""
    if is_weights_BT is not None:
        pg_BT = pg_BT * is_weights_BT
    loss_BT = pg_BT
    kl_BT = torch.zeros_like(pg_BT)
    if kl_coef > 0:
        assert ref_logprobs_BT is not None, "kl_coef > 0 needs reference logprobs"
        kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, kl_estimator)
        loss_BT = loss_BT + kl_coef * kl_BT
    loss = aggregate(loss_BT, mask_BT, loss_agg, num_global_tokens, num_global_seqs)
    with torch.no_grad():
        ratio = torch.exp(logprobs_BT - old_logprobs_BT)
        return LossOutput(
            loss=loss,
            policy_loss_sum=(pg_BT * mask_BT).sum(),
            kl_sum=(kl_BT * mask_BT).sum(),
            clipped_tokens=(clipped_BT.float() * mask_BT).sum(),
            ratio_max=(ratio * mask_BT).max() if mask_BT.any() else ratio.new_tensor(1.0),
        )

"""GRPO: group-relative advantages and a clipped policy-gradient loss with an optional KL term.

Shao et al., "DeepSeekMath" (2024), arXiv:2402.03300. For G samples of one prompt with rewards
r_1..r_G, each sample's advantage is

    A_i = (r_i - mean(r)) / (std(r) + eps)        (std division off: Dr.GRPO, arXiv:2503.20783)

applied to every token of the sample, and the loss per token t is

    L_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)) + beta * KL_t,
    r_t = pi(y_t | ...) / pi_old(y_t | ...),

with clip-higher (eps_high > eps_low) from DAPO (arXiv:2503.14476), KL_t one of k1/k2/k3 to a
frozen reference policy, aggregated by `common.aggregate`.
"""

from dataclasses import dataclass

import torch

from titanrl.algorithms.common import aggregate, clipped_surrogate, kl_estimate


def group_advantages(rewards_N: torch.Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards laid out as consecutive groups of `group_size` samples."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not form groups of {group_size}")
    r_GS = rewards_N.float().view(-1, group_size)
    centred = r_GS - r_GS.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        # Unbiased std, as in the paper's implementation; a group of equal rewards gets 0.
        centred = centred / (r_GS.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Local share of the global loss (sum over ranks/micro-batches is the full loss)."""
    policy_loss_sum: torch.Tensor
    kl_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_max: torch.Tensor


def grpo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    num_global_tokens: float,
    num_global_seqs: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> LossOutput:
    advantages_BT = advantages_B[:, None].expand_as(logprobs_BT)
    pg_BT, clipped_BT = clipped_surrogate(logprobs_BT, old_logprobs_BT, advantages_BT, clip_low, clip_high)
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

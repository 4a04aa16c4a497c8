"""CISPO: clipped importance-sampling-weight policy optimisation — clip the weight, not the update.

MiniMax, "MiniMax-M1: scaling test-time compute efficiently with lightning attention" (2025),
arXiv:2506.13585, section 3.1. With group-relative advantages A_i (`grpo.group_advantages`),
r_t = pi(y_t) / pi_old(y_t) and sg the stop-gradient,

    L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(y_t),

aggregated over tokens (the paper's 1 / sum_i |y_i|: "token-mean"; any `algorithm.loss_agg`
works). The gradient of every token is clip(r_t) * A_t * grad log pi(y_t): a token whose ratio
left the range keeps its gradient with a capped weight, where PPO's clipped surrogate would zero
it (the paper's point: rare "fork" tokens such as "However" or "Recheck" get large ratios after
the first off-policy update and must keep contributing). The bounds are `algorithm.clip_eps_low`
/ `clip_eps_high`; the paper imposes no lower bound (a large eps_low: clip_eps_low >= 1 means a
lower bound <= 0, which a ratio never reaches) and tunes only eps_high.

On-policy (one update per batch) the weight is 1 and the gradient is GRPO's; the clip acts with
several mini-batches or epochs (`num_minibatches`, `ppo_epochs`).
"""

import torch

from titanrl.algorithms.common import LossAgg, LossOutput, _finish, per_token
from titanrl.algorithms.grpo import GRPO


def cispo_weights(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped IS weight sg(clip(r_t, 1 - eps_low, 1 + eps_high)) and where it was capped."""
    ratio_BT = torch.exp(logprobs_BT.detach() - old_logprobs_BT.detach())
    weight_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    return weight_BT, weight_BT != ratio_BT


def cispo_loss(
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
    kl_clamp: bool = True,
    loss_agg_norm: float = 0.0,
) -> LossOutput:
    """CISPO's loss; `advantages` per sequence [B] or per token [B, T], `is_weights_BT` the
    off-policy (generator vs trainer) weights, KL to the reference added as in `clipped_pg_loss`.
    The clipped-token count is the number of tokens whose IS weight was capped."""
    advantages_BT = per_token(advantages, logprobs_BT)
    weight_BT, clipped_BT = cispo_weights(logprobs_BT, old_logprobs_BT, clip_low, clip_high)
    pg_BT = -weight_BT * advantages_BT * logprobs_BT
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
        loss_agg_norm=loss_agg_norm,
        kl_clamp=kl_clamp,
    )


class CISPO(GRPO):
    """GRPO's group-relative advantages with CISPO's clipped-IS-weight loss (`cispo_loss`)."""

    name = "cispo"
    dual_clip = False  # the clip is on the IS weight, not the surrogate

    def loss(
        self,
        logprobs_BT,
        old_logprobs_BT,
        advantages,
        mask_BT,
        *,
        num_global_tokens,
        num_global_seqs,
        ref_logprobs_BT,
        is_weights_BT,
    ) -> LossOutput:
        c = self.config
        return cispo_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages,
            mask_BT,
            clip_low=c.clip_eps_low,
            clip_high=c.clip_eps_high,
            loss_agg=c.loss_agg,
            loss_agg_norm=c.loss_agg_norm,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            **self.kl_term(ref_logprobs_BT),
            is_weights_BT=is_weights_BT,
        )

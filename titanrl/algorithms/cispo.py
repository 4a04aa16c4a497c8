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

from titanrl.algorithms.common import LossInputs, LossOutput, PolicyTerm, loss_arguments, policy_loss
from titanrl.algorithms.grpo import GRPO


def cispo_term(inputs: LossInputs, clip_low: float, clip_high: float) -> PolicyTerm:
    """-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(y_t); the clipped tokens are those
    whose IS weight was capped."""
    logprobs_BT = inputs.logprobs_BT
    ratio_BT = torch.exp(logprobs_BT.detach() - inputs.old_logprobs_BT.detach())
    weight_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyTerm(-weight_BT * inputs.advantages_BT * logprobs_BT, weight_BT != ratio_BT)


def cispo_loss(
    logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, clip_low: float, clip_high: float, **kw
) -> LossOutput:
    """CISPO's loss in keyword form; `kw` as `common.clipped_pg_loss`'s (`common.loss_arguments`)."""
    inputs, spec = loss_arguments(logprobs_BT, old_logprobs_BT, advantages, mask_BT, **kw)
    return policy_loss(cispo_term(inputs, clip_low, clip_high), inputs, spec)


class CISPO(GRPO):
    """GRPO's group-relative advantages with CISPO's clipped-IS-weight policy term."""

    name = "cispo"
    dual_clip = False  # the clip is on the IS weight, not the surrogate

    def policy_term(self, inputs: LossInputs) -> PolicyTerm:
        return cispo_term(inputs, self.config.clip_eps_low, self.config.clip_eps_high)

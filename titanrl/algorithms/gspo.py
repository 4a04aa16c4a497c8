"""GSPO: group sequence policy optimisation — one importance ratio per sequence.

Zheng et al., "Group sequence policy optimization" (2025), arXiv:2507.18071. With group-relative
advantages A_i (`grpo.group_advantages`) and the length-normalised sequence ratio

    s_i = (pi(y_i) / pi_old(y_i)) ^ (1/|y_i|) = exp(1/|y_i| * sum_t log(pi(y_i,t) / pi_old(y_i,t))),

the loss per sequence is max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)) (the paper's
clip ranges are ~3e-4 / 4e-4). It is written in the GSPO-token form
s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], whose value is s_i on every token and whose gradient
equals the sequence form's under per-sequence mean aggregation ("seq-mean-token-mean").
"""

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import LossInputs, LossOutput, PolicyTerm, loss_arguments, policy_loss
from titanrl.algorithms.grpo import GroupSettings, group_advantages


def gspo_term(inputs: LossInputs, clip_low: float, clip_high: float) -> PolicyTerm:
    """max(-A_i s_i,t, -A_i clip(s_i,t, 1 - eps_low, 1 + eps_high)) with the GSPO-token ratio
    s_i,t; the ratio logged is the sequence ratio s_i."""
    logprobs_BT, mask_BT = inputs.logprobs_BT, inputs.mask_BT
    lengths_B = mask_BT.sum(-1).clamp(min=1.0)
    seq_log_ratio_B = ((logprobs_BT - inputs.old_logprobs_BT) * mask_BT).sum(-1) / lengths_B
    ratio_BT = torch.exp(seq_log_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach())
    adv_BT = inputs.advantages_BT
    unclipped = -adv_BT * ratio_BT
    clipped = -adv_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyTerm(torch.maximum(unclipped, clipped), clipped > unclipped, ratio_BT.detach())


def gspo_loss(
    logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, *, clip_low: float, clip_high: float, **kw
) -> LossOutput:
    """GSPO's loss in keyword form, aggregated per sequence ("seq-mean-token-mean"); `kw` as
    `common.clipped_pg_loss`'s but for loss_agg (`common.loss_arguments`)."""
    inputs, spec = loss_arguments(
        logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, loss_agg="seq-mean-token-mean", **kw
    )
    return policy_loss(gspo_term(inputs, clip_low, clip_high), inputs, spec)


class GSPO(Algorithm):
    """Group-relative advantages with one clipped ratio per sequence (`gspo_term`)."""

    name = "gspo"
    Settings = GroupSettings
    token_advantages = False  # one ratio, so one advantage, per sequence
    dual_clip = False  # its clip is on the sequence ratio

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        if config.algorithm.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                "[algorithm] 'gspo' clips one ratio per sequence and averages per sequence; set "
                "loss_agg = 'seq-mean-token-mean'"
            )

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        c = self.config
        return Advantages(group_advantages(self.sequence_rewards(inputs), c.group_size, self.settings.normalize_std))

    def policy_term(self, inputs: LossInputs) -> PolicyTerm:
        return gspo_term(inputs, self.config.clip_eps_low, self.config.clip_eps_high)

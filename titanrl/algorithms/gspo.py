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
from titanrl.algorithms.common import LossOutput, _finish
from titanrl.algorithms.grpo import GroupSettings, group_advantages


def gspo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    num_global_tokens: float,
    num_global_seqs: float,
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights_BT: torch.Tensor | None = None,
    kl_clamp: bool = True,
) -> LossOutput:
    lengths_B = mask_BT.sum(-1).clamp(min=1.0)
    seq_log_ratio_B = ((logprobs_BT - old_logprobs_BT) * mask_BT).sum(-1) / lengths_B
    log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach()
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages_B[:, None].expand_as(logprobs_BT)
    unclipped = -adv_BT * ratio_BT
    clipped = -adv_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    pg_BT = torch.maximum(unclipped, clipped)
    # The ratio reported is the sequence ratio: pass a log ratio that reproduces it.
    old_for_stats_BT = logprobs_BT.detach() - log_ratio_BT.detach()
    return _finish(
        pg_BT,
        clipped > unclipped,
        logprobs_BT,
        old_for_stats_BT,
        mask_BT,
        "seq-mean-token-mean",
        num_global_tokens,
        num_global_seqs,
        ref_logprobs_BT,
        kl_coef,
        kl_estimator,
        is_weights_BT,
        kl_clamp=kl_clamp,
    )


class GSPO(Algorithm):
    """Group-relative advantages with one clipped ratio per sequence (`gspo_loss`)."""

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
        return gspo_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages,
            mask_BT,
            clip_low=c.clip_eps_low,
            clip_high=c.clip_eps_high,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            **self.kl_term(ref_logprobs_BT),
            is_weights_BT=is_weights_BT,
        )

"""REINFORCE++: per-token discounted returns of token-level rewards, normalised over the whole
global batch (no critic), optionally after a per-prompt group baseline.

Hu, "REINFORCE++: a simple and efficient approach for aligning large language models" (2025),
arXiv:2501.03262. With token rewards r_t = -beta * KL_t (+ the sequence score on the last token),

    G_t = sum_{s >= t} gamma^(s-t) r_s,        A_t = (G_t - mean(G)) / std(G)

where mean and std run over every completion token of the global batch (all dp ranks;
`common.masked_whiten`, population std). The loss is `common.clipped_pg_loss` with these
per-token advantages.

REINFORCE++-baseline (`[algorithm.reinforce_pp] baseline = "group"`: REINFORCE++ with a
per-prompt mean baseline, verl's `reinforce_plus_plus_baseline`, OpenRLHF's `reinforce_baseline`):
each score first has its group's mean score subtracted,

    s'_i = s_i - mean_{j in group(i)} s_j        (float64; exactly 0 in a group of equal scores)

and s'_i replaces s_i on the last token before the returns and the global whitening above. The
group mean removes the prompt's difficulty, the whitening the batch's reward scale. Needs
group_size >= 2. (verl subtracts the group mean of the KL-penalised total and puts it on every
token; titanrl and OpenRLHF centre the score and keep the KL per token: the two agree without a
KL in the reward and with gamma = 1.)
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import (
    advantage_dtype,
    discounted_returns,
    group_centred,
    masked_whiten,
    token_rewards,
)

__all__ = ["ReinforcePP", "ReinforcePPSettings", "discounted_returns", "reinforce_pp_advantages"]


def reinforce_pp_advantages(
    scores_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None,
    kl_coef: float,
    gamma: float,
    dp_group: dist.ProcessGroup | None = None,
    turn_scores: list[list[float]] | None = None,
    baseline_group_size: int = 0,
) -> torch.Tensor:
    """Whitened discounted returns of the token rewards; with `baseline_group_size` = G >= 2 the
    scores are first centred on the mean of their group of G (REINFORCE++-baseline). Multi-turn:
    the group mean of the episode totals comes off each episode's last turn reward."""
    if baseline_group_size:
        if baseline_group_size < 2:
            raise ValueError("REINFORCE++-baseline needs algorithm.group_size >= 2 (the baseline is the group mean)")
        centred_B = group_centred(scores_B, baseline_group_size)
        if turn_scores is not None:
            means = (scores_B.double() - centred_B).tolist()
            turn_scores = [[*turns[:-1], turns[-1] - mean] for turns, mean in zip(turn_scores, means)]
        scores_B = centred_B.to(advantage_dtype(scores_B))
    rewards_BT = token_rewards(scores_B, mask_BT, kl_BT, kl_coef, turn_scores)
    return masked_whiten(discounted_returns(rewards_BT, mask_BT, gamma), mask_BT, dp_group)


@dataclass
class ReinforcePPSettings:
    """`[algorithm.reinforce_pp]`: the discount of token returns and the baseline."""

    gamma: float = 1.0
    """Discount of token rewards in the returns G_t."""

    baseline: Literal["none", "group"] = "none"
    """'group' subtracts each prompt's mean score from its samples' scores before the returns and
    the global whitening (REINFORCE++-baseline; needs algorithm.group_size >= 2); 'none' is plain
    REINFORCE++."""

    def validate(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"[algorithm.reinforce_pp] gamma must be in [0, 1], got {self.gamma}")


class ReinforcePP(Algorithm):
    name = "reinforce_pp"
    Settings = ReinforcePPSettings
    # Even with the group baseline, the global whitening gives a group of equal rewards advantages.
    group_baseline = False

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        if cls.read_settings(config.algorithm).baseline == "group" and config.algorithm.group_size < 2:
            raise ValueError(
                "[algorithm.reinforce_pp] baseline = 'group' needs algorithm.group_size >= 2 (a sample's baseline "
                "is its group's mean); raise group_size or set baseline = 'none'"
            )

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        c = self.config
        return Advantages(
            reinforce_pp_advantages(
                inputs.rewards_N,
                inputs.mask_BT,
                inputs.kl_BT,
                c.kl_coef,
                self.settings.gamma,
                inputs.dp_group,
                inputs.turn_scores,
                c.group_size if self.settings.baseline == "group" else 0,
            )
        )

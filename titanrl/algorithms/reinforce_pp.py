"""REINFORCE++: per-token discounted returns of token-level rewards, normalised over the whole
global batch (no critic, no per-prompt baseline).

Hu, "REINFORCE++: a simple and efficient approach for aligning large language models" (2025),
arXiv:2501.03262. With token rewards r_t = -beta * KL_t (+ the sequence score on the last token),

    G_t = sum_{s >= t} gamma^(s-t) r_s,        A_t = (G_t - mean(G)) / std(G)

where mean and std run over every completion token of the global batch (all dp ranks). The loss
is `common.clipped_pg_loss` with these per-token advantages.
"""

import torch
import torch.distributed as dist

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import masked_whiten, token_rewards


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over masked tokens (masked positions pass G through unchanged)."""
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t]
        running_B = torch.where(m > 0, rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B * m
    return returns_BT


def reinforce_pp_advantages(
    scores_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None,
    kl_coef: float,
    gamma: float,
    dp_group: dist.ProcessGroup | None = None,
    turn_scores: list[list[float]] | None = None,
) -> torch.Tensor:
    rewards_BT = token_rewards(scores_B, mask_BT, kl_BT, kl_coef, turn_scores)
    return masked_whiten(discounted_returns(rewards_BT, mask_BT, gamma), mask_BT, dp_group)


class ReinforcePP(Algorithm):
    name = "reinforce_pp"
    group_baseline = False

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        c = self.config
        return Advantages(
            reinforce_pp_advantages(
                inputs.rewards_N, inputs.mask_BT, inputs.kl_BT, c.kl_coef, c.gamma, inputs.dp_group, inputs.turn_scores
            )
        )

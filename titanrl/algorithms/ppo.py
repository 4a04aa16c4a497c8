"""PPO with a learned critic: GAE advantages and a clipped value loss.

Schulman et al., "Proximal policy optimization algorithms" (2017), arXiv:1707.06347, and
"High-dimensional continuous control using generalized advantage estimation" (2016),
arXiv:1506.02438; the LLM recipe of Ouyang et al. (2022). With token rewards r_t (the sequence
score on its last token, optionally -beta * KL_t on every token; `common.token_rewards`) and the
critic's values V_t of the states before each completion token,

    delta_t = r_t + gamma * V_{t+1} - V_t            (V after the last token is 0)
    A_t     = delta_t + gamma * lambda * A_{t+1},     R_t = A_t + V_t (the critic's target)

and the critic minimises the clipped value loss

    L^V_t = 1/2 * max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -eps_v, eps_v) - R_t)^2).

The policy loss is `common.clipped_pg_loss` on the (globally whitened) A_t.
"""

from dataclasses import dataclass

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import masked_whiten, token_rewards


def gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both zero outside the mask. Masked positions (prompt, padding) are
    skipped: the recursion links each completion token to the next *masked-in* one."""
    advantages_BT = torch.zeros_like(rewards_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t] > 0
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_BT[:, t] = torch.where(m, adv_B, 0.0)
        next_value_B = torch.where(m, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(m, adv_B, next_adv_B)
    returns_BT = (advantages_BT + values_BT) * mask_BT
    return advantages_BT, returns_BT


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float,
    num_global_tokens: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(local share of the token-mean clipped value loss, number of tokens whose clipped term won).
    `clip` <= 0 disables clipping."""
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip > 0:
        clipped_values_BT = old_values_BT + torch.clamp(values_BT - old_values_BT, -clip, clip)
        clipped_BT = (clipped_values_BT - returns_BT) ** 2
        loss_BT = torch.maximum(unclipped_BT, clipped_BT)
        n_clipped = ((clipped_BT > unclipped_BT).float() * mask_BT).sum().detach()
    else:
        loss_BT, n_clipped = unclipped_BT, values_BT.new_tensor(0.0)
    return 0.5 * (loss_BT * mask_BT).sum() / num_global_tokens, n_clipped


@dataclass
class PPOSettings:
    """`[algorithm.ppo]`: GAE's discount and lambda."""

    gamma: float = 1.0
    """Discount of token rewards."""

    lam: float = 1.0
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors."""

    def validate(self) -> None:
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"[algorithm.ppo] {name} must be in [0, 1], got {getattr(self, name)}")


class PPO(Algorithm):
    """GAE advantages (whitened over the global batch) from the critic's values; the critic
    regresses on the returns with `value_loss`."""

    name = "ppo"
    Settings = PPOSettings
    needs_critic = True
    group_baseline = False

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        c = self.config
        assert inputs.values_BT is not None, "PPO needs the critic's values"
        rewards_BT = token_rewards(inputs.rewards_N, inputs.mask_BT, inputs.kl_BT, c.kl_coef, inputs.turn_scores)
        adv_BT, returns_BT = gae(rewards_BT, inputs.values_BT, inputs.mask_BT, self.settings.gamma, self.settings.lam)
        return Advantages(masked_whiten(adv_BT, inputs.mask_BT, inputs.dp_group), returns_BT)

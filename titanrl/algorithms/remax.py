"""ReMax: REINFORCE with the greedy response's reward as baseline.

Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
Large Language Models" (ICML 2024), arXiv:2310.10505. For each prompt x, G >= 1 sampled
responses y_i and one greedy response y_bar (argmax decoding, not trained on),

    A_i = r(x, y_i) - r(x, y_bar),

a baseline that depends only on x, so the gradient stays unbiased; unlike group baselines it
needs no second sample, which is why ReMax works with G = 1. The loss is
`common.clipped_pg_loss` with the sequence advantage on every response token.

With the KL in the reward (`algorithm.kl_in_reward`, kl_coef = beta) `[algorithm.remax] kl_reward`
chooses how the penalty enters:

    "sequence"       A_i   = r(x, y_i) - beta * sum_s KL_i,s - r(x, y_bar)   (one advantage per sequence)
    "reward_to_go"   A_i,t = r(x, y_i) - beta * sum_{s >= t} KL_i,s - r(x, y_bar)

"reward_to_go" is the per-token return of the token rewards -beta * KL_t (plus the score on the
last token) minus the greedy reward: a token is charged only for the KL of itself and what
follows it, which its choice can affect. It is the ReMax estimator of verl
(`compute_remax_outcome_advantage`: reversed cumulative sum of the token-level rewards, minus the
baseline; verl/trainer/ppo/core_algos.py) and REINFORCE's reward-to-go (Williams 1992; Sutton
and Barto, "Reinforcement learning", 2nd ed., sec. 13.3). In both the greedy reward carries no KL.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import advantage_dtype, discounted_returns, token_rewards


def _greedy_per_sample(rewards_N: torch.Tensor, greedy_rewards_P: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each sample's prompt's greedy reward [N], float64."""
    if rewards_N.numel() != greedy_rewards_P.numel() * group_size:
        raise ValueError(
            f"{rewards_N.numel()} rewards do not form groups of {group_size} for "
            f"{greedy_rewards_P.numel()} greedy baselines"
        )
    return greedy_rewards_P.double().to(rewards_N.device).repeat_interleave(group_size)


def remax_advantages(rewards_N: torch.Tensor, greedy_rewards_P: torch.Tensor, group_size: int) -> torch.Tensor:
    """Advantages of P * group_size rewards (consecutive groups per prompt) against each
    prompt's greedy reward, in float64, returned in `common.advantage_dtype` of the rewards."""
    greedy_N = _greedy_per_sample(rewards_N, greedy_rewards_P, group_size)
    return (rewards_N.double() - greedy_N).to(advantage_dtype(rewards_N))


def remax_reward_to_go_advantages(
    rewards_N: torch.Tensor,
    greedy_rewards_P: torch.Tensor,
    group_size: int,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """A_t = r_i - kl_coef * sum_{s >= t} KL_s - r_greedy on each completion token, 0 elsewhere
    [B, T]: the reward-to-go of `common.token_rewards` minus the greedy reward. Computed in
    float64, returned in `common.advantage_dtype` of the rewards."""
    greedy_N = _greedy_per_sample(rewards_N, greedy_rewards_P, group_size)
    rewards_BT = token_rewards(rewards_N.double(), mask_BT, kl_BT.double(), kl_coef)
    returns_BT = discounted_returns(rewards_BT, mask_BT, 1.0)
    return ((returns_BT - greedy_N[:, None]) * mask_BT).to(advantage_dtype(rewards_N))


@dataclass
class ReMaxSettings:
    """`[algorithm.remax]`: how a KL in the reward enters the advantage."""

    kl_reward: Literal["sequence", "reward_to_go"] = "sequence"
    """With algorithm.kl_in_reward: 'sequence' subtracts kl_coef * (the sequence's summed KL) from
    its reward (one advantage per sequence); 'reward_to_go' charges each token the KL of itself and
    the tokens after it (verl's ReMax: a per-token advantage)."""


class ReMax(Algorithm):
    name = "remax"
    Settings = ReMaxSettings
    needs_baseline_rollout = True
    group_baseline = False

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        algo = config.algorithm
        if cls.read_settings(algo).kl_reward == "reward_to_go" and not (algo.kl_in_reward and algo.kl_coef > 0):
            raise ValueError(
                "[algorithm.remax] kl_reward = 'reward_to_go' shapes the KL in the reward, which is off: set "
                "algorithm.kl_in_reward = true and kl_coef > 0, or remove kl_reward"
            )

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        assert inputs.baseline_rewards_P is not None, "ReMax needs the greedy baseline's rewards"
        G = self.config.group_size
        if self.settings.kl_reward == "reward_to_go" and inputs.kl_BT is not None:
            return Advantages(
                remax_reward_to_go_advantages(
                    inputs.rewards_N, inputs.baseline_rewards_P, G, inputs.mask_BT, inputs.kl_BT, self.config.kl_coef
                )
            )
        return Advantages(remax_advantages(self.sequence_rewards(inputs), inputs.baseline_rewards_P, G))

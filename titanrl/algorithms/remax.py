"""ReMax: REINFORCE with the greedy response's reward as baseline.

Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
Large Language Models" (ICML 2024), arXiv:2310.10505. For each prompt x, G >= 1 sampled
responses y_i and one greedy response y_bar (argmax decoding, not trained on),

    A_i = r(x, y_i) - r(x, y_bar),

a baseline that depends only on x, so the gradient stays unbiased; unlike group baselines it
needs no second sample, which is why ReMax works with G = 1. The loss is
`common.clipped_pg_loss` with the sequence advantage on every response token.
"""

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm


def remax_advantages(rewards_N: torch.Tensor, greedy_rewards_P: torch.Tensor, group_size: int) -> torch.Tensor:
    """Advantages of P * group_size rewards (consecutive groups per prompt) against each
    prompt's greedy reward."""
    if rewards_N.numel() != greedy_rewards_P.numel() * group_size:
        raise ValueError(
            f"{rewards_N.numel()} rewards do not form groups of {group_size} for "
            f"{greedy_rewards_P.numel()} greedy baselines"
        )
    r_PG = rewards_N.float().view(-1, group_size)
    return (r_PG - greedy_rewards_P.float().to(r_PG.device)[:, None]).view(-1)


class ReMax(Algorithm):
    name = "remax"
    needs_baseline_rollout = True
    group_baseline = False

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        assert inputs.baseline_rewards_P is not None, "ReMax needs the greedy baseline's rewards"
        return Advantages(
            remax_advantages(self.sequence_rewards(inputs), inputs.baseline_rewards_P, self.config.group_size)
        )

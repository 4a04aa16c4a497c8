"""RLOO: REINFORCE with a leave-one-out baseline.

Kool et al., "Buy 4 REINFORCE samples, get a baseline for free!" (2019); Ahmadian et al.,
"Back to basics" (2024), arXiv:2402.14740. For G >= 2 samples of one prompt,

    A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r)),

an unbiased baseline (it does not depend on sample i). The loss is `common.clipped_pg_loss`.
"""

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm


def rloo_advantages(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages for rewards laid out as consecutive groups of `group_size`."""
    if group_size < 2:
        raise ValueError("RLOO needs algorithm.group_size >= 2 (the baseline leaves one sample out)")
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not form groups of {group_size}")
    r_GS = rewards_N.float().view(-1, group_size)
    baseline_GS = (r_GS.sum(dim=1, keepdim=True) - r_GS) / (group_size - 1)
    return (r_GS - baseline_GS).view(-1)


class RLOO(Algorithm):
    name = "rloo"

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        if config.algorithm.group_size < 2:
            raise ValueError("[algorithm] 'rloo' needs group_size >= 2 (the baseline leaves one sample out)")

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        return Advantages(rloo_advantages(self.sequence_rewards(inputs), self.config.group_size))

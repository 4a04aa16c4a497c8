"""RLOO: REINFORCE with a leave-one-out baseline.

Kool et al., "Buy 4 REINFORCE samples, get a baseline for free!" (2019); Ahmadian et al.,
"Back to basics" (2024), arXiv:2402.14740. For G >= 2 samples of one prompt,

    A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean(r)),

an unbiased baseline (it does not depend on sample i). The loss is `common.clipped_pg_loss`.
Groups of one are rejected (verl gives such a sample A = r).
"""

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import advantage_dtype, equal_groups, group_rewards


def rloo_advantages(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages for rewards laid out as consecutive groups of `group_size`, in
    float64 (exactly 0 for a group of equal rewards), returned in `common.advantage_dtype`."""
    if group_size < 2:
        raise ValueError("RLOO needs algorithm.group_size >= 2 (the baseline leaves one sample out)")
    r_PG = group_rewards(rewards_N, group_size)
    baseline_PG = (r_PG.sum(dim=1, keepdim=True) - r_PG) / (group_size - 1)
    advantages_PG = torch.where(equal_groups(r_PG), 0.0, r_PG - baseline_PG)
    return advantages_PG.view(-1).to(advantage_dtype(rewards_N))


class RLOO(Algorithm):
    name = "rloo"

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        if config.algorithm.group_size < 2:
            raise ValueError("[algorithm] 'rloo' needs group_size >= 2 (the baseline leaves one sample out)")

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        return Advantages(rloo_advantages(self.sequence_rewards(inputs), self.config.group_size))

"""GRPO (and Dr.GRPO, DAPO's advantages): group-relative advantages.

Shao et al., "DeepSeekMath" (2024), arXiv:2402.03300. For G samples of one prompt with rewards
r_1..r_G, each sample's advantage is

    A_i = (r_i - mean(r)) / (std(r) + eps)

applied to every token of the sample (computed in float64; exactly 0 for a group of equal
rewards); the loss is `common.clipped_pg_loss`. Dr.GRPO (Liu et al.,
"Understanding R1-Zero-like training", arXiv:2503.20783) drops the std division
(`[algorithm.grpo] normalize_std = false`) and the per-sequence length normalisation
(`algorithm.loss_agg = "seq-mean-token-sum"`, or "seq-mean-token-sum-norm" with the paper's
constant normaliser, verl's Dr.GRPO setting). DAPO (arXiv:2503.14476) uses these advantages with
clip-higher, a token-level loss and the sampling/length shaping in `dapo.py`.
"""

from dataclasses import dataclass

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm
from titanrl.algorithms.common import advantage_dtype, equal_groups, group_rewards


@dataclass
class GroupSettings:
    """Settings of the group-relative algorithms (`[algorithm.grpo]`, and the same key in the
    tables of 'gspo', 'cispo' and 'sapo')."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group std; false for Dr.GRPO."""


def group_advantages(rewards_N: torch.Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards laid out as consecutive groups of `group_size` samples.

    Computed in float64 and returned in `common.advantage_dtype` of the rewards; a group whose
    rewards are all equal (max == min) gets exactly 0. (In float32 the mean of G equal rewards
    that are not binary fractions, e.g. eight of 0.7, can come out one rounding step off; the std
    is then ~1e-8 and (r - mean) / (std + eps) gave the whole group an advantage of about 0.06, of
    one sign.) A group of one is its own mean: advantage 0 (verl gives it the raw reward, with
    mean 0 and std 1)."""
    r_PG = group_rewards(rewards_N, group_size)
    centred = r_PG - r_PG.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        # Unbiased std, as in the paper's implementation and verl's.
        centred = centred / (r_PG.std(dim=1, keepdim=True) + eps)
    centred = torch.where(equal_groups(r_PG), 0.0, centred)
    return centred.view(-1).to(advantage_dtype(rewards_N))


class GRPO(Algorithm):
    """Group-relative advantages (`group_advantages`); with the KL in the reward, the sequence
    KL is subtracted from each reward first."""

    name = "grpo"
    Settings = GroupSettings

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        rewards_N = self.sequence_rewards(inputs)
        return Advantages(group_advantages(rewards_N, self.config.group_size, self.settings.normalize_std))

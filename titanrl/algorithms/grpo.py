"""GRPO (and Dr.GRPO, DAPO's advantages): group-relative advantages.

Shao et al., "DeepSeekMath" (2024), arXiv:2402.03300. For G samples of one prompt with rewards
r_1..r_G, each sample's advantage is

    A_i = (r_i - mean(r)) / (std(r) + eps)

applied to every token of the sample; the loss is `common.clipped_pg_loss`. Dr.GRPO (Liu et al.,
"Understanding R1-Zero-like training", arXiv:2503.20783) drops the std division
(`algorithm.normalize_std = false`) and the per-sequence length normalisation
(`algorithm.loss_agg = "seq-mean-token-sum"`). DAPO (arXiv:2503.14476) uses these advantages with
clip-higher, a token-level loss and the sampling/length shaping in `dapo.py`.
"""

import torch

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm


def group_advantages(rewards_N: torch.Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for rewards laid out as consecutive groups of `group_size` samples."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not form groups of {group_size}")
    r_GS = rewards_N.float().view(-1, group_size)
    centred = r_GS - r_GS.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        # Unbiased std, as in the paper's implementation; a group of equal rewards gets 0.
        centred = centred / (r_GS.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


class GRPO(Algorithm):
    """Group-relative advantages (`group_advantages`); with the KL in the reward, the sequence
    KL is subtracted from each reward first."""

    name = "grpo"

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        c = self.config
        return Advantages(group_advantages(self.sequence_rewards(inputs), c.group_size, c.normalize_std))

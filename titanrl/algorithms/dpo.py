"""DPO: direct preference optimisation on (prompt, chosen, rejected) triples.

Rafailov et al., "Direct preference optimization" (2023), arXiv:2305.18290. With sequence
log-probabilities of the completions under the policy and a frozen reference,

    h = beta * ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)))
    L = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)

where eps is label smoothing (conservative DPO; 0 is the paper's loss). The implicit rewards
beta * (log pi - log pi_ref) of chosen and rejected, and their margin, are the usual metrics.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DPOOutput:
    loss_B: torch.Tensor
    chosen_reward_B: torch.Tensor
    rejected_reward_B: torch.Tensor


def dpo_loss(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> DPOOutput:
    chosen = policy_chosen_B - ref_chosen_B
    rejected = policy_rejected_B - ref_rejected_B
    h = beta * (chosen - rejected)
    loss = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return DPOOutput(loss, (beta * chosen).detach(), (beta * rejected).detach())


def bradley_terry_loss(chosen_scores_B: torch.Tensor, rejected_scores_B: torch.Tensor) -> torch.Tensor:
    """Reward-model loss -log sigmoid(s_w - s_l) (Ouyang et al. 2022), per pair."""
    return -F.logsigmoid(chosen_scores_B - rejected_scores_B)

"""SAPO: soft adaptive policy optimisation — a smooth gate on the ratio instead of a hard clip.

Gao et al. (Qwen), "Soft adaptive policy optimization" (2025), arXiv:2511.20347. With
group-relative advantages A_i (`grpo.group_advantages`) and r_t = pi(y_t) / pi_old(y_t),

    f(r_t) = sigmoid(tau_t * (r_t - 1)) * 4 / tau_t,   tau_t = tau_pos if A_t > 0 else tau_neg,
    L_t = -f(r_t) * A_t,

aggregated by `algorithm.loss_agg` (the paper averages per sequence, 1/G sum_i 1/|y_i| sum_t:
"seq-mean-token-mean"). The gradient is

    grad L_t = -w_t * A_t * r_t * grad log pi(y_t),   w_t = 4 sigmoid(x) (1 - sigmoid(x)), x = tau_t (r_t - 1),

so on-policy (r_t = 1, w_t = 1) it is the plain policy gradient, and as r_t leaves 1 the weight
decays smoothly to 0, faster for larger tau: no token's gradient is cut off at a boundary as in
PPO's clip. The paper sets tau_neg > tau_pos (1.05 vs 1.0) because negative updates raise the
logits of many unsampled tokens and destabilise training sooner. The temperatures are
`[algorithm.sapo] tau_pos` / `tau_neg`; `clip_eps_low` / `clip_eps_high` are not used.
"""

from dataclasses import dataclass

import torch

from titanrl.algorithms.common import LossInputs, LossOutput, PolicyTerm, loss_arguments, policy_loss
from titanrl.algorithms.grpo import GRPO, GroupSettings


def sapo_gate(
    ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """f(r_t) = sigmoid(tau_t (r_t - 1)) * 4 / tau_t, with tau_t chosen by the sign of A_t, and
    whether its gradient weight w_t = f'(r_t) = 4 sigmoid (1 - sigmoid) is below 1/2."""
    # Tensors of the ratio's dtype: python scalars would make a float32 tau even for float64 ratios.
    tau_BT = torch.where(advantages_BT > 0, ratio_BT.new_tensor(tau_pos), ratio_BT.new_tensor(tau_neg))
    p_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    with torch.no_grad():
        damped_BT = 4.0 * p_BT * (1.0 - p_BT) < 0.5
    return p_BT * (4.0 / tau_BT), damped_BT


def sapo_term(inputs: LossInputs, tau_pos: float, tau_neg: float) -> PolicyTerm:
    """-f(r_t) * A_t; nothing is clipped: the "clipped" tokens are those whose gate weight w_t is
    below 1/2 (the gate has at least halved their importance-weighted gradient)."""
    advantages_BT = inputs.advantages_BT
    ratio_BT = torch.exp(inputs.logprobs_BT - inputs.old_logprobs_BT)
    gate_BT, damped_BT = sapo_gate(ratio_BT, advantages_BT, tau_pos, tau_neg)
    return PolicyTerm(-gate_BT * advantages_BT, damped_BT, ratio_BT.detach())


def sapo_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT, *, tau_pos: float, tau_neg: float, **kw) -> LossOutput:
    """SAPO's loss in keyword form; `kw` as `common.clipped_pg_loss`'s (`common.loss_arguments`)."""
    inputs, spec = loss_arguments(logprobs_BT, old_logprobs_BT, advantages, mask_BT, **kw)
    return policy_loss(sapo_term(inputs, tau_pos, tau_neg), inputs, spec)


@dataclass
class SAPOSettings(GroupSettings):
    """`[algorithm.sapo]`: the soft gate's temperatures (and GRPO's normalize_std)."""

    tau_pos: float = 1.0
    """Temperature of the soft gate on tokens with a positive advantage."""

    tau_neg: float = 1.05
    """Temperature of the soft gate on tokens with a negative advantage (the paper's choice is a
    little above tau_pos, so negative updates decay faster off-policy)."""

    def validate(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:  # the gate divides by tau
                raise ValueError(f"[algorithm.sapo] {name} must be > 0, got {getattr(self, name)}")


class SAPO(GRPO):
    """GRPO's group-relative advantages with SAPO's soft-gated policy term."""

    name = "sapo"
    Settings = SAPOSettings
    dual_clip = False  # a soft gate, no clip

    def policy_term(self, inputs: LossInputs) -> PolicyTerm:
        return sapo_term(inputs, self.settings.tau_pos, self.settings.tau_neg)

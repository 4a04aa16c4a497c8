"""The `[moe]` section: how a mixture-of-experts policy trains (the model's shape is [model])."""

from dataclasses import dataclass


@dataclass
class Moe:
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (Switch / Qwen3-MoE, mean over MoE layers) in every
    backward through an MoE model: its gradient is added to each forward's backward (as Megatron
    does), scaled by 1 / dp ranks, so it is a mean over ranks and a sum over micro-batches.
    0 = off (Qwen3-MoE's released weights use 0.001)."""

    bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE layer's
    expert bias moves by this rate towards balance (bias += rate * sign(mean load - load), loads
    summed over dp ranks since the last step, every forward counted). Needs a model with
    `moe_expert_bias`; 0 = off."""

    def validate(self) -> None:
        for name in ("aux_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"[moe] {name} must be >= 0, got {getattr(self, name)}")

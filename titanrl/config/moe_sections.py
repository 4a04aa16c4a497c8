"""The `[moe]` section: how a mixture-of-experts policy trains and how the RL loop treats its
routing (the model's shape is [model]). A docstring under every field; `validate()` checks them."""

from dataclasses import dataclass
from typing import Literal

ROUTING_REPLAY_MODES = ("off", "rollout")


@dataclass
class MoE:
    routing_replay: Literal["off", "rollout"] = "off"
    """'rollout': the trainer's logprob and update passes route every token of a sample to the
    experts the generator chose for it (recorded per MoE layer while prefilling and decoding),
    with the router's weights recomputed from its current probabilities, so the router still
    gets gradients ("routing replay", R3). 'off': the trainer's routers choose again. Either way
    the share of (token, layer) decisions on which generator and trainer disagree is logged
    (`moe_route_disagree`). Ignored for dense models."""

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
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"[moe] routing_replay must be one of {ROUTING_REPLAY_MODES}, got '{self.routing_replay}'")
        for name in ("aux_loss_coeff", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"[moe] {name} must be >= 0, got {getattr(self, name)}")

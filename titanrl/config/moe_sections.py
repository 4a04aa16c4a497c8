"""The `[moe]` section: how the RL loop treats a mixture-of-experts policy. A docstring under
every field; `validate()` checks them."""

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

    def validate(self) -> None:
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"[moe] routing_replay must be one of {ROUTING_REPLAY_MODES}, got '{self.routing_replay}'")

"""The policy model: `[model]` (its shape and weights), `[lora]` (adapters) and `[moe]` (how
a mixture-of-experts policy trains and how the RL loop treats its routing). A docstring under every
field; each section checks its own fields in `validate()`."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Model:
    flavor: str = "debug"
    """Named model shape from the registry (`titanrl.models.flavors`), e.g. 'debug', 'qwen3-0.6b'."""

    hf_checkpoint: str = ""
    """Hugging Face folder (config.json + safetensors) to load; empty trains the flavor from scratch."""

    tokenizer: str = "byte"
    """'byte' for the built-in byte tokenizer, or a folder holding a Hugging Face tokenizer.json."""

    max_seq_len: int = 0
    """Override of the flavor's maximum sequence length (RoPE table size); 0 keeps the flavor's."""

    def validate(self) -> None:
        if self.max_seq_len < 0:
            raise ValueError(f"[model] max_seq_len must be >= 0 (0 = flavor default), got {self.max_seq_len}")


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""Linear layers of a block that can carry an adapter, and their Hugging Face names (same order)."""


LORA_HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj")


LORA_LINEAR_ATTN_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
"""Qwen3.5: the gated DeltaNet layers' projections that can carry an adapter (same names in HF)."""


def lora_target(name: str) -> str:
    """The titanrl name (wq, ..., w3) of a LoRA target given by either name."""
    if name in LORA_HF_TARGETS:
        return LORA_TARGETS[LORA_HF_TARGETS.index(name)]
    if name not in LORA_TARGETS + LORA_LINEAR_ATTN_TARGETS:
        raise ValueError(
            f"[lora] unknown target module '{name}'; choose from {', '.join(LORA_TARGETS)} "
            f"(or their Hugging Face names {', '.join(LORA_HF_TARGETS)}; Qwen3.5's linear attention: "
            f"{', '.join(LORA_LINEAR_ATTN_TARGETS)})"
        )
    return name


@dataclass
class LoRA:
    enable: bool = False
    """Train low-rank adapters (Hu et al., arXiv:2106.09685) on the target projections with the
    base weights frozen: only adapters are in the optimizer and the checkpoint, and the reference
    policy is the base model with adapters off (no second copy of the weights)."""

    rank: int = 8
    """Adapter rank r: each target W [out, in] gains B [out, r] @ A [r, in]."""

    alpha: float = 16.0
    """Adapter scale numerator: the update is (alpha / rank) * B @ A (PEFT's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input during training (PEFT's lora_dropout)."""

    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    """Block projections that get adapters, by titanrl name (wq, wk, wv, wo, w1, w2, w3) or by
    Hugging Face name (q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj); hybrid
    models (Qwen3.5) also in_proj_qkv, in_proj_z, out_proj of their linear-attention layers (a
    block gets the targets it has)."""

    generator: Literal["merged", "runtime"] = "merged"
    """How the generator serves base + adapter: 'merged' folds (alpha / rank) * B @ A into its own
    copy of the weights at every sync (plain matmuls while decoding, faster than 'runtime': see
    bench_lora in docs/benchmarks.md); 'runtime' applies the adapters in its
    forward (on one rank it shares the trainer's storage: no second copy of the weights)."""

    export_peft: bool = True
    """With checkpoint.export_hf, also write a PEFT adapter folder (`adapter_config.json` +
    `adapter_model.safetensors`) beside the merged HF checkpoint."""

    def validate(self) -> None:
        if not self.enable:
            return
        if self.rank < 1:
            raise ValueError(f"[lora] rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"[lora] alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"[lora] dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("[lora] target_modules is empty; name at least one projection, e.g. ['wq', 'wv']")
        for name in self.target_modules:
            lora_target(name)


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

"""Sections that change how the policy is trained or taught rather than what: LoRA adapters,
float8 linear layers, and on-policy distillation from a teacher. A docstring under every field;
each section checks its own fields in `validate()`."""

from dataclasses import dataclass, field
from typing import Literal

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""Linear layers of a block that can carry an adapter, and their Hugging Face names (same order)."""
LORA_HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj")


def lora_target(name: str) -> str:
    """The titanrl name (wq, ..., w3) of a LoRA target given by either name."""
    if name in LORA_HF_TARGETS:
        return LORA_TARGETS[LORA_HF_TARGETS.index(name)]
    if name not in LORA_TARGETS:
        raise ValueError(
            f"[lora] unknown target module '{name}'; choose from {', '.join(LORA_TARGETS)} "
            f"(or their Hugging Face names {', '.join(LORA_HF_TARGETS)})"
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
    Hugging Face name (q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj)."""

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


@dataclass
class Float8:
    enable: bool = False
    """Train the block linears in float8 with dynamic tensorwise scaling through torchao
    (`convert_to_float8_training`, as TorchTitan's [float8]); the generator stays in the
    trainer's precision."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe: one scale per tensor, or one per row (more accurate)."""

    enable_fsdp_float8_all_gather: bool = False
    """FSDP2 all-gathers the float8-cast weights instead of the high-precision ones (tensorwise);
    ignored on a single data-parallel rank, where nothing is all-gathered. Every block is then
    resharded after its forward (whatever parallelism.fsdp_reshard_after_forward says): an
    unsharded float8 weight cannot be checkpointed or copied."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers left in high precision (fully qualified name contains one of these). Only the
    block projections are ever converted (embeddings and the output head never are), and a
    projection whose dims are not multiples of 16 stays in high precision too."""

    emulate: bool = False
    """Emulate the float8 matmuls (float8-cast operands, float32 matmul) instead of
    `torch._scaled_mm`: for GPUs without float8 support (before SM89); same casts, no speedup."""

    def validate(self) -> None:
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError("[float8] enable_fsdp_float8_all_gather needs recipe = 'tensorwise'")


@dataclass
class Distillation:
    teacher_hf_checkpoint: str = ""
    """Hugging Face folder of the teacher (same tokenizer and vocabulary as the student); empty
    turns on-policy distillation off."""

    coef: float = 1.0
    """Weight of the distillation advantage -(log pi_student - log pi_teacher) per token
    ('reverse_kl'), or of the JSD loss term ('jsd'): A_t = task_reward_coef * A_task + coef * A_distill."""

    task_reward_coef: float = 0.0
    """Weight of the algorithm's task-reward advantages mixed in (0: pure distillation)."""

    divergence: Literal["reverse_kl", "jsd"] = "reverse_kl"
    """'reverse_kl': per-token advantage -(log pi_s - log pi_t) on the student's samples (Agarwal
    et al. GKD, Thinking Machines' on-policy distillation); 'jsd': GKD's generalised
    Jensen-Shannon divergence with weight jsd_beta, over the full vocabulary at every completion
    position, as a loss term (coef x its token mean; the advantages keep only the task term), in
    chunks of training.logprob_chunk_tokens; one rank without FSDP for now
    (`titanrl/rl/distillation.py`)."""

    jsd_beta: float = 0.5
    """Interpolation weight of the generalised JSD (0 -> forward KL, 1 -> reverse KL)."""

    def validate(self) -> None:
        if self.coef < 0 or self.task_reward_coef < 0:
            raise ValueError("[distillation] coef and task_reward_coef must be >= 0")
        if self.teacher_hf_checkpoint and self.coef == 0 and self.task_reward_coef == 0:
            raise ValueError(
                "[distillation] coef and task_reward_coef are both 0: nothing would be learned; set coef > 0"
            )
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"[distillation] jsd_beta must be in (0, 1), got {self.jsd_beta}")

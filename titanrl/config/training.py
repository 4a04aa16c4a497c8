"""How an update step runs: `[training]` (batch, micro-batches, packing, precision),
`[optimizer]`, `[lr_scheduler]`, and what makes the step cheaper (`[activation_checkpoint]`,
`[compile]`, `[float8]`). A docstring under every field; each section checks its own fields in
`validate()`."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Training:
    steps: int = 100
    """Number of optimizer steps."""

    batch_size: int = 16
    """Global rows per step, split across dp ranks: prompts for 'rl' (each sampled
    algorithm.group_size times), demonstrations for 'sft', preference pairs for 'dpo' / 'reward_model'."""

    micro_batch_tokens: int = 0
    """Token budget of one forward/backward (gradient accumulation) in every recipe and the SFT
    warm-up: sequences are sorted by length and split into about
    padded tokens / budget micro-batches, as many on every dp rank (a preference pair stays in
    one); 0 = the whole mini-batch."""

    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; 0 disables clipping."""

    logprob_chunk_tokens: int = 256
    """Positions whose logits are computed at once for logprobs and entropy (forward, and again
    in backward); memory for logits is this x vocab floats instead of tokens x vocab. Large enough
    for the matrix product to run at full speed, small enough to keep the buffer small at a
    150k vocabulary (docs/benchmarks.md: bench_logprob_memory)."""

    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype of parameters in forward/backward (FSDP2's mixed precision, also on one rank; master
    weights and optimizer state stay float32). The generator holds its weights in this dtype, so
    sampler and trainer compute alike."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under FSDP2."""

    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient norm: 'skip' drops that update (counted in metrics), 'stop' ends the run."""

    packing: Literal["auto", "on", "off"] = "auto"
    """RL recipe: run the model over packed rows (sequences concatenated, attention within each,
    positions restarting at 0; `titanrl/data/packing.py`) instead of right-padded ones, for the
    policy update, reference / old logprobs and critic. Same losses up to float rounding (bitwise
    in batch-invariant mode). 'auto' = on when the padded micro-batches would hold at least 1.15
    times the packed token slots (long-tailed lengths); 'off' = padded rows."""

    balance_tokens: bool = True
    """RL recipe, dp > 1: before the logprob passes and the update, whole groups move between dp
    ranks so that each computes about as many prompt + response tokens (largest group first, to
    the least-loaded rank; `titanrl/distributed/balance.py`). Every rank waits for the slowest at
    each collective, and with long-tailed responses the rank that generated a long group
    otherwise sets the step's time. Same losses up to float rounding; off: each rank trains what it generated.
    Only with algorithm.num_minibatches = 1: each rank splits its rows into mini-batches in
    order, so moving groups would change which samples share an optimizer step."""

    def validate(self) -> None:
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"[training] logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        for name in ("steps", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"[training] {name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"[training] batch_size must be >= 1, got {self.batch_size}")
        if self.max_norm < 0:
            raise ValueError(f"[training] max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Optimizer class from `torch.optim`."""

    lr: float = 1e-5
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1 (ignored by SGD)."""

    beta2: float = 0.95
    """Adam beta2 (ignored by SGD)."""

    eps: float = 1e-8
    """Adam epsilon (ignored by SGD)."""

    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (Adam, SGD)."""

    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """Kernel style of the optimizer step; 'fused' needs a device that supports it."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"[optimizer] lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"[optimizer] {name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"[optimizer] weight_decay must be >= 0, got {self.weight_decay}")


@dataclass
class LRScheduler:
    warmup_steps: int = 0
    """Steps of linear warm-up from lr * 1/(warmup_steps+1) to lr."""

    decay_type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay after warm-up, down to lr * min_lr_factor at the last step."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of the peak (for 'linear' and 'cosine')."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"[lr_scheduler] warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"[lr_scheduler] min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """'full' recomputes each block in backward; 'selective' recomputes per `selective_ac_option`."""

    selective_ac_option: str = "op"
    """'op': save matmul/attention outputs and recompute the rest; an integer N: checkpoint every Nth block."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        if self.mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ValueError(
                f"[activation_checkpoint] selective_ac_option must be 'op' or a positive integer, got '{opt}'"
            )


@dataclass
class Compile:
    enable: bool = False
    """Compile each transformer block with `torch.compile(fullgraph=True)`."""

    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """`torch.compile` backend; 'aot_eager' is a fast-to-compile debugging aid."""


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

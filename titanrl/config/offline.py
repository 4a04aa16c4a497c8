"""Training on fixed data: `[sft_warmup]` (supervised steps on worked solutions before RL, and
the SFT recipe's settings) and `[dpo]` (the DPO recipe's loss). A docstring under every field;
each section checks its own fields in `validate()`."""

from dataclasses import dataclass


@dataclass
class SFTWarmup:
    steps: int = 0
    """Supervised steps on worked solutions before RL (the 'sft' recipe's step), so that a model
    trained from scratch can start; skipped when the run resumes from a checkpoint."""

    lr: float = 1e-3
    """Learning rate of the warm-up (constant; its own AdamW, not [optimizer]'s)."""

    batch_size: int = 64
    """Global sequences per warm-up step."""

    beta1: float = 0.9
    """Adam beta1 of the warm-up optimizer."""

    beta2: float = 0.99
    """Adam beta2 of the warm-up optimizer."""

    weight_decay: float = 0.0
    """Weight decay of the warm-up optimizer."""

    seed_offset: int = 7919
    """The warm-up's data order is seeded with job.seed + seed_offset, so that it differs from
    the RL prompts' order."""

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"[sft_warmup] steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"[sft_warmup] lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"[sft_warmup] batch_size must be >= 1, got {self.batch_size}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"[sft_warmup] {name} must be in [0, 1), got {getattr(self, name)}")


@dataclass
class DPO:
    beta: float = 0.1
    """DPO's beta: strength of the implicit KL to the reference (the starting policy)."""

    label_smoothing: float = 0.0
    """Conservative-DPO label smoothing in [0, 0.5): assumed fraction of flipped preferences."""

    def validate(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"[dpo] beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"[dpo] label_smoothing must be in [0, 0.5), got {self.label_smoothing}")

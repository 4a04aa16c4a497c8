"""`[preflight]`: what `titanrl run` checks in its own process before torchrun starts a rank:
the memory plan of the job on its world size (`titanrl plan`). A docstring under every field;
`validate()` checks them."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Preflight:
    plan: Literal["auto", "on", "off"] = "auto"
    """Plan the job's memory per rank for the launch's world size before any rank starts
    (`titanrl plan`, docs/scaling.md) and refuse, with the plan's one-line reason, a job whose
    mesh cannot be built or whose peak does not fit the device: 'auto' = on when the launch has
    more than 8 ranks; needs a fixed world size (--nproc and --nnodes numbers)."""

    device_memory_gb: float = 0.0
    """Memory of one device in GiB for that plan; 0 reads it from this machine's first GPU (the
    plan is skipped, with a notice, on a machine without one)."""

    prompt_tokens: int = 512
    """Prompt length the plan assumes per sample (completions are generator.max_new_tokens long)."""

    def validate(self) -> None:
        if self.plan not in ("auto", "on", "off"):
            raise ValueError(f"[preflight] plan must be 'auto', 'on' or 'off', got '{self.plan}'")
        if self.device_memory_gb < 0:
            raise ValueError(
                f"[preflight] device_memory_gb must be >= 0 (0 = this machine's GPU), got {self.device_memory_gb}"
            )
        if self.prompt_tokens < 1:
            raise ValueError(f"[preflight] prompt_tokens must be >= 1, got {self.prompt_tokens}")

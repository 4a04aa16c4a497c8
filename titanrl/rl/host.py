"""What rollout code needs of the process that runs it: the `Trainer` on a colocated rank, a
`RolloutWorker` on a one-step rollout rank. Typed as a protocol so that `rl/` sits below the
trainer and the recipes (it never imports them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from titanrl.config import JobConfig
    from titanrl.data.encode import PromptEncoder
    from titanrl.distributed import ParallelDims
    from titanrl.models.args import TransformerModelArgs
    from titanrl.models.tokenizer import Tokenizer


class RolloutHost(Protocol):
    config: JobConfig
    """The job's configuration."""

    dims: ParallelDims
    """This rank's place in the mesh (`dp_rank`, `dp_size`, ...)."""

    device: torch.device
    """Where the generator and the models run."""

    tokenizer: Tokenizer
    """The policy's tokenizer."""

    encode_prompt: PromptEncoder
    """Prompt text (or chat messages) -> token ids, with the chat template when configured."""

    dp_group: dist.ProcessGroup | None
    """The data-parallel group for step-wide sums and maxima; None on one rank."""

    rank: int
    """This process's global rank (rank 0 writes human-facing output)."""


class TrainerHost(RolloutHost, Protocol):
    """A host that also trains a policy (what on-policy distillation needs of the `Trainer`)."""

    model: nn.Module
    """The policy being trained."""

    model_args: TransformerModelArgs
    """The policy's shape."""

"""What a recipe is: the part of a job that is not the same for every job.

A recipe is built by the `Trainer` (`titanrl/trainer.py`) after the Trainer's shared parts
(mesh, tokenizer, model, optimizer, lr schedule, checkpointer, metrics) and builds what it needs
on top (data loader, generator, rewards, reference, critic ...). The Trainer's loop calls
`prepare()` once on a fresh run, `step()` every step, and `evaluate()` at the eval interval.
Fork a recipe to experiment: `titanrl cp rl my_rl.py` copies one with its config, and
`job.recipe = "my_rl.py"` (or 'package.module:Class') trains the copy (`recipes/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from titanrl.components.model_builder import build_model
from titanrl.config import JobConfig
from titanrl.models.model import Transformer

if TYPE_CHECKING:  # the Trainer imports the recipes; recipes only need its type
    from titanrl.trainer import Trainer


class Recipe:
    name: ClassVar[str] = ""
    console: ClassVar[dict[str, str]] = {}
    """Metrics printed on the console line (metric -> short label); the file and wandb get all."""

    loader: Any
    """The training data loader (a torchdata `Loader`: its state is checkpointed)."""

    @classmethod
    def load_data(cls, config: JobConfig) -> Any:
        """Read the recipe's data before anything is built, so that bad data fails in seconds."""
        return None

    @classmethod
    def build_model(cls, trainer: Trainer) -> Transformer:
        """The trained model (the policy), placed on the Trainer's mesh."""
        cfg = trainer.config
        return build_model(
            trainer.model_args,
            trainer.dims,
            cfg,
            trainer.device,
            hf_checkpoint=cfg.model.hf_checkpoint,
            lora=cfg.lora if cfg.lora.enable else None,
        )

    def __init__(self, trainer: Trainer, data: Any) -> None:
        self.trainer = trainer
        self.config = trainer.config

    def checkpoint_parts(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """Models and optimizers to checkpoint beside the Trainer's model and optimizer."""
        return {}, {}

    def state_dict(self) -> dict[str, Any]:
        """Host state to checkpoint beyond the loader's (per rank, e.g. RL's groups in flight)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned ({} for a checkpoint saved without it)."""

    def prepare(self) -> None:
        """Once, on a fresh run (not on resume), before the step-0 evaluation."""

    def step(self, batches: Iterator, step: int) -> dict[str, float]:
        """One training step on the next batch(es) of `batches`; returns its metrics."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, reduced over ranks."""
        raise NotImplementedError

    def close(self) -> None:
        """Release workers and files."""

"""DPO against a frozen copy of the starting policy (`algorithms/dpo.py`).

    python -m titanrl.train --job.config_file train_configs/dpo_reverse_debug.toml

Pairs as in `preference.py`; [dpo] sets beta and label smoothing. Export with
`checkpoint.export_hf` to continue from the result (`model.hf_checkpoint`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from torch import nn

from titanrl.algorithms.dpo import dpo_loss
from titanrl.components.model_builder import build_reference
from titanrl.models.lora import AdaptersOff
from titanrl.models.model import Transformer
from titanrl.recipes.preference import PreferencePair, PreferenceRecipe

if TYPE_CHECKING:
    from titanrl.trainer import Trainer


def sequence_logprobs(model: Transformer | AdaptersOff, batch: TensorDict, chunk_tokens: int) -> torch.Tensor:
    """Sum of completion-token logprobs per row [B]."""
    tokens_BT = batch["tokens"]
    logprobs_BT, _ = model.logprobs(tokens_BT[:, :-1], tokens_BT[:, 1:], chunk_tokens, mask_BT=batch["loss_mask"])
    return (logprobs_BT * batch["loss_mask"]).sum(-1)


class DPORecipe(PreferenceRecipe):
    name = "dpo"

    def __init__(self, trainer: Trainer, data: tuple[list[PreferencePair], list[PreferencePair]]) -> None:
        super().__init__(trainer, data)
        # A copy of the policy, or a LoRA policy's base (its adapters off).
        self.reference = build_reference(trainer.model, trainer.dims, self.config, trainer.device)

    def checkpoint_parts(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        return ({"reference": self.reference} if isinstance(self.reference, nn.Module) else {}), {}

    def margins(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO's implicit reward margin and loss per pair."""
        n = batch.batch_size[0] // 2
        chunk = self.config.training.logprob_chunk_tokens
        policy_lp = sequence_logprobs(self.trainer.model, batch, chunk)
        with torch.no_grad():
            ref_lp = sequence_logprobs(self.reference, batch, chunk)
        cfg = self.config.dpo
        out = dpo_loss(policy_lp[:n], policy_lp[n:], ref_lp[:n], ref_lp[n:], cfg.beta, cfg.label_smoothing)
        return (out.chosen_reward_B - out.rejected_reward_B).detach(), out.loss_B

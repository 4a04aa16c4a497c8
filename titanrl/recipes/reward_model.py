"""Reward-model training: Bradley-Terry on a one-label score head (`algorithms/dpo.py`).

    python -m titanrl.train --job.config_file train_configs/reward_model_reverse_debug.toml

Pairs as in `preference.py`. The model is the LM's trunk (model.hf_checkpoint, or a fresh init)
under a new one-label head; export it with `checkpoint.export_hf` and score RL with it
(`reward.model_path`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from titanrl.algorithms.dpo import bradley_terry_loss
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.models.hf import from_hf_state_dict, load_safetensors_folder
from titanrl.models.model import Transformer
from titanrl.recipes.preference import PreferenceRecipe

if TYPE_CHECKING:
    from titanrl.trainer import Trainer


class RewardModelRecipe(PreferenceRecipe):
    name = "reward_model"

    @classmethod
    def build_model(cls, trainer: Trainer) -> Transformer:
        config, args = trainer.config, trainer.model_args
        hf = config.model.hf_checkpoint
        rm_args = dataclasses.replace(args, num_labels=1)
        if hf and args.num_labels == 1:  # already a score model: train it further
            return build_model(rm_args, trainer.dims, config, trainer.device, hf_checkpoint=hf)
        sd = (
            from_hf_state_dict(load_safetensors_folder(hf), args)
            if hf
            else init_full_state_dict(rm_args, config.job.seed)
        )
        if args.num_labels != 1:
            sd.pop("output.weight", None)
            sd["output.weight"] = torch.zeros(1, args.dim)
        return build_model(rm_args, trainer.dims, config, trainer.device, full_state_dict=sd)

    def margins(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Score margin and Bradley-Terry loss per pair; a sequence's score is its last token's."""
        n = batch.batch_size[0] // 2
        scores_BT = self.trainer.model(batch["tokens"])[..., 0].float()
        scores_B = scores_BT.gather(1, (batch["length"] - 1)[:, None]).squeeze(1)
        return (scores_B[:n] - scores_B[n:]).detach(), bradley_terry_loss(scores_B[:n], scores_B[n:])

"""Outputs of one-label scalar-head models (`num_labels = 1`): a critic's value at every
position, a reward model's score of a whole sequence (built in `components/model_builder.py`)."""

import torch

from titanrl.models.model import Transformer


def values(model: Transformer, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Value of the state before each next token: [B, T-1], aligned with the batch's loss_mask."""
    return model(tokens_BT[:, :-1])[..., 0].float()


@torch.no_grad()
def sequence_scores(model: Transformer, tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Score at each row's last real token [B] (right padding, as HF's classifier picks it)."""
    scores_BT = model(tokens_BT)[..., 0].float()
    return scores_BT.gather(1, (lengths_B.to(scores_BT.device) - 1)[:, None]).squeeze(1)

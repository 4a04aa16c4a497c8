"""Scalar-head models on the trainer's mesh: reward models and critics.

Both are `Transformer`s with `num_labels = 1` (HF `*ForSequenceClassification` layout: the LM
head replaced by `score.weight`), parallelized like the policy (TP, FSDP2). A reward model scores
a sequence at its last token; a critic gives a value at every position.
"""

from dataclasses import replace

import torch

from titanrl.components.model_builder import build_model
from titanrl.config.job_config import JobConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import from_hf_state_dict, load_safetensors_folder, read_hf_config
from titanrl.models.model import Transformer


def build_reward_model(folder: str, dims: ParallelDims, config: JobConfig, device: torch.device,
                       policy_args: TransformerModelArgs) -> Transformer:
    """A frozen one-label score model from an HF folder, checked against the policy's vocabulary."""
    args = read_hf_config(folder)
    if args.num_labels != 1:
        raise ValueError(
            f"reward.model_path '{folder}' is not a one-label sequence-classification model "
            f"(num_labels={args.num_labels}); export a *ForSequenceClassification with num_labels=1"
        )
    if args.vocab_size < policy_args.vocab_size:
        raise ValueError(
            f"reward model vocab ({args.vocab_size}) is smaller than the policy's ({policy_args.vocab_size}); "
            "the reward model must share the policy's tokenizer"
        )
    return build_model(args, dims, config, device, hf_checkpoint=folder).requires_grad_(False)


def build_critic(policy: Transformer, policy_full_sd: dict[str, torch.Tensor], dims: ParallelDims,
                 config: JobConfig, device: torch.device) -> Transformer:
    """A value model: from critic.hf_checkpoint, or the policy's current weights; a new head
    (zeros, so the first values are 0) unless the checkpoint already has a one-label head."""
    folder = config.critic.hf_checkpoint
    if folder:
        src_args = read_hf_config(folder)
        if src_args.num_labels not in (0, 1):
            raise ValueError(f"critic.hf_checkpoint '{folder}' has {src_args.num_labels} labels; need 0 (LM) or 1")
        sd = from_hf_state_dict(load_safetensors_folder(folder), src_args)
        args = replace(src_args, num_labels=1)
        if src_args.num_labels == 0:
            sd.pop("output.weight")
    else:
        args = replace(policy.args, num_labels=1)
        sd = {k: v for k, v in policy_full_sd.items() if k != "output.weight"}
    sd.setdefault("output.weight", torch.zeros(1, args.dim))
    return build_model(args, dims, config, device, full_state_dict=sd)


def values(model: Transformer, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Value of the state before each next token: [B, T-1], aligned with the batch's loss_mask."""
    return model(tokens_BT[:, :-1])[..., 0].float()


@torch.no_grad()
def sequence_scores(model: Transformer, tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Score at each row's last real token [B] (right padding, as HF's classifier picks it)."""
    scores_BT = model(tokens_BT)[..., 0].float()
    return scores_BT.gather(1, (lengths_B.to(scores_BT.device) - 1)[:, None]).squeeze(1)

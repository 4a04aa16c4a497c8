"""The supervised loss and loss normalisation by a global token count.

Logprobs come from `titanrl/models/logprobs.py` (`Transformer.logprobs` in the trainer, without
[B, T, vocab] logits; `token_logprobs` on the generator's sampled rows): the same ops per row,
so sampler and trainer logprobs agree by construction.
"""

import torch
import torch.distributed as dist


def global_token_count(mask_BT: torch.Tensor, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of loss tokens summed over data-parallel ranks (at least 1)."""
    count = mask_BT.sum().to(torch.float32)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, group=dp_group)
    return count.clamp(min=1.0)


def sft_loss(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, num_global_tokens: torch.Tensor) -> torch.Tensor:
    """Sum of -log p over masked tokens / global token count.

    Dividing every rank's sum by the same global count, with FSDP summing gradients, gives the
    exact gradient of the mean over all tokens, however unevenly tokens fall on ranks.
    """
    return (-logprobs_BT * mask_BT).sum() / num_global_tokens


__all__ = ["global_token_count", "sft_loss"]

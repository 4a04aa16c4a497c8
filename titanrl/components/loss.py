"""Token log-probabilities and the supervised loss, normalised by a global token count.

`token_logprobs` is the one place logprobs are computed from logits; the generator and every
RL loss call it, so sampler and trainer logprobs agree by construction.
"""

import torch
import torch.distributed as dist


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, in float32: [B, T]."""
    logprobs_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return logprobs_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def global_token_count(mask_BT: torch.Tensor, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of loss tokens summed over data-parallel ranks (at least 1)."""
    count = mask_BT.sum().to(torch.float32)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(count, group=dp_group)
    return count.clamp(min=1.0)


def sft_loss(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, mask_BT: torch.Tensor, num_global_tokens: torch.Tensor
) -> torch.Tensor:
    """Sum of -log p over masked tokens / global token count.

    Dividing every rank's sum by the same global count, with FSDP summing gradients, gives the
    exact gradient of the mean over all tokens, however unevenly tokens fall on ranks.
    """
    nll_BT = -token_logprobs(logits_BTV, targets_BT)
    return (nll_BT * mask_BT).sum() / num_global_tokens

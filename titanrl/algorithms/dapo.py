"""DAPO's data-side techniques: dynamic sampling and overlong reward shaping.

Yu et al., "DAPO: an open-source LLM reinforcement learning system at scale" (2025),
arXiv:2503.14476. DAPO trains with group-relative advantages (`grpo.py`), clip-higher
(eps_high > eps_low) and a token-level loss ("token-mean"), plus:

- Dynamic sampling: a group whose G rewards are all equal has zero advantage and no gradient;
  such groups are dropped and more prompts are sampled until the batch is full
  (`informative_groups`; the loop, its cap and its metrics are in `rl/rollouts.py`).
- Overlong reward shaping: with the length limit L_max and a buffer L_cache,

      R_len(y) = 0                                if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               = -1                               if |y| > L_max

  is added to the reward, times a factor (`overlong_penalty`).
- Overlong filtering: truncated samples (no stop token within L_max) are masked out of the loss.
"""

import torch


def informative_groups(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool per group [N / G]: True where the group's rewards are not all equal."""
    r_GS = rewards_N.view(-1, group_size)
    return (r_GS.max(dim=1).values - r_GS.min(dim=1).values) > 0


def overlong_penalty(lengths_N: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """The soft length penalty R_len above, times `factor` (0 for lengths within the safe zone)."""
    if buffer_len <= 0:
        return torch.zeros_like(lengths_N, dtype=torch.float32)
    safe = max_len - buffer_len
    lengths = lengths_N.float()
    penalty = torch.where(lengths <= safe, 0.0, (safe - lengths) / buffer_len)
    return factor * torch.where(lengths > max_len, -1.0, penalty)

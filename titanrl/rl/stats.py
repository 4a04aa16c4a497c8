"""One RL step's statistics: sums and maxima on this rank, reduced over ranks in one collective
(`StepStats.reduced`); the recipe turns them into the logged metrics."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titanrl.components.step_stats import StepStats, maximum
from titanrl.rewards.runner import RewardStats
from titanrl.rl.distillation import DistillStats

if TYPE_CHECKING:
    from titanrl.rl.groups import Rollouts


@dataclasses.dataclass
class RLStats(DistillStats, RewardStats, StepStats):
    """One RL step's sums (and maxima) on this rank; `reduced` combines the ranks."""

    samples: float = 0.0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    correct: float = 0.0
    response_tokens: float = 0.0
    gen_tokens: float = 0.0
    rm_score_sum: float = 0.0
    baseline_reward_sum: float = 0.0
    baseline_samples: float = 0.0
    env_turns: float = 0.0
    env_failures: float = 0.0
    decode_steps: float = maximum(0.0)
    gen_compile_s: float = maximum(0.0)
    sampling_rounds: float = maximum(0.0)
    dropped_groups: float = 0.0
    short_groups: float = 0.0
    overlong_filtered: float = 0.0
    update_tokens: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clipped: float = 0.0
    gen_diff: float = 0.0
    mismatch_kl: float = 0.0
    is_dropped: float = 0.0
    ratio_max: float = maximum(0.0)
    mismatch_ratio_max: float = maximum(0.0)
    skipped_updates: float = maximum(0.0)  # counted alike on every rank (the grad norm is global)
    value_loss: float = 0.0
    value_clipped: float = 0.0
    value_tokens: float = 0.0

    def add_rollouts(self, generated: Rollouts) -> None:
        """`generated`'s samples, rewards and counts."""
        rewards = torch.tensor(generated.rewards)
        self.samples += len(generated.results)
        self.reward_sum += rewards.sum().item()
        self.reward_sq_sum += (rewards**2).sum().item()
        self.correct += sum(r.correct for r in generated.results)
        self.response_tokens += sum(len(c.token_ids) for c in generated.completions)
        self.add_reward_results(generated.results)
        self.baseline_reward_sum += sum(generated.baseline_rewards)
        self.baseline_samples += len(generated.baseline_rewards)
        c = generated.counts
        self.gen_tokens += c.gen_tokens
        self.env_turns += c.env_turns
        self.env_failures += c.env_failures
        self.rm_score_sum += c.rm_score_sum
        self.decode_steps = max(self.decode_steps, float(c.decode_steps))
        self.gen_compile_s = max(self.gen_compile_s, float(c.compile_s))
        self.sampling_rounds = max(self.sampling_rounds, c.sampling_rounds)
        self.dropped_groups += c.dropped_groups
        self.short_groups += c.short_groups

    def rollout_metrics(self, generated: Rollouts, group: dist.ProcessGroup | None) -> dict[str, float]:
        """On the reduced stats: the tail of this step's responses over the data-parallel `group`
        (what sets a synchronous step's length; collective, unless `balance_groups` gathered the
        lengths), the most decode steps and compile seconds of a rank, and `generated`'s metrics."""
        gathered = generated.lengths_by_rank
        if gathered is None:
            gathered = [generated.lengths()]
            if group is not None:
                gathered = [[] for _ in range(dist.get_world_size(group))]
                dist.all_gather_object(gathered, generated.lengths(), group=group)
        lengths_N = torch.tensor(sum(gathered, []), dtype=torch.float)
        q50, q90 = torch.quantile(lengths_N, torch.tensor([0.5, 0.9])).tolist()
        return {
            "response_len_p50": q50,
            "response_len_p90": q90,
            "response_len_max": lengths_N.max().item(),
            "decode_steps": self.decode_steps,
            "gen_compile_s": self.gen_compile_s,
            **generated.metrics,
        }

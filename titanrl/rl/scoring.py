"""Scoring rollouts: the verifier's result of each completion (computed in the reward workers, at
once or streamed in as samples finish), then the total reward: weighted verifier + reward model
+ DAPO's overlong shaping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titanrl.algorithms.dapo import overlong_penalty
from titanrl.data.batch import build_sequence_batch, plan_micro_batches, trim_padding
from titanrl.data.tasks import Sample
from titanrl.generator import Completion
from titanrl.models.model import Transformer
from titanrl.models.scalar_head import sequence_scores
from titanrl.rewards.runner import RewardItem, RewardResult, RewardRunner

if TYPE_CHECKING:
    from collections.abc import Callable

    from titanrl.rl.host import RolloutHost


def reward_item(sample: Sample, c: Completion) -> RewardItem:
    """What the verifier scores: `c`, a completion of `sample`."""
    assert c.text is not None, "completions are decoded before they are scored"
    return RewardItem(sample.prompt, c.text, sample.answer, sample.metadata)


@dataclass
class StreamedResults:
    """Verifier results being computed in the reward workers, submitted in `order`."""

    rewards: RewardRunner
    order: list[tuple[int, int]]

    def wait(self, completions: list[Completion]) -> list[RewardResult]:
        """The results, in the order of `completions`."""
        by_key = dict(zip(self.order, self.rewards.finish()))
        return [by_key[(c.prompt_index, c.sample_index)] for c in completions]


Pending = list[RewardResult] | StreamedResults | None
"""Verifier results as generation leaves them: the episodes' (multi-turn), the verifier's being
streamed, or None (not computed yet)."""


class Scorer:
    """Scores completions with the reward workers and an optional reward model."""

    def __init__(self, host: RolloutHost, rewards: RewardRunner, reward_model: Transformer | None) -> None:
        self.host, self.config = host, host.config
        self.rewards, self.reward_model = rewards, reward_model

    def stream(self, samples: list[Sample]) -> tuple[Callable[[list[Completion]], None], StreamedResults]:
        """(the generator's `on_finish`, which sends finished completions of `samples` to the
        reward workers, and their results to wait for)."""
        order: list[tuple[int, int]] = []

        def on_finish(finished: list[Completion]) -> None:
            order.extend((c.prompt_index, c.sample_index) for c in finished)
            self.rewards.submit([reward_item(samples[c.prompt_index], c) for c in finished])

        self.rewards.begin()
        return on_finish, StreamedResults(self.rewards, order)

    def score(
        self, samples: list[Sample], prompts: list[list[int]], completions: list[Completion], results: Pending
    ) -> tuple[list[RewardResult], torch.Tensor, float]:
        """(verifier results, total rewards [N], reward-model score sum)."""
        results = self.verify(samples, completions, results)
        return (results, *self.total_rewards(prompts, completions, results))

    def verify(self, samples: list[Sample], completions: list[Completion], results: Pending) -> list[RewardResult]:
        """The verifier's (or the episodes') result of each completion."""
        if results is None:
            return self.rewards([reward_item(samples[c.prompt_index], c) for c in completions])
        if isinstance(results, StreamedResults):
            return results.wait(completions)
        return results

    def total_rewards(
        self, prompts: list[list[int]], completions: list[Completion], results: list[RewardResult]
    ) -> tuple[torch.Tensor, float]:
        """(total rewards [N]: weighted verifier + reward model + overlong penalty, reward-model score sum)."""
        cfg = self.config
        rewards_N = cfg.reward.verifier_weight * torch.tensor([r.reward for r in results])
        rm_sum = 0.0
        if self.reward_model is not None:
            scores = self.reward_model_scores(
                [prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions]
            )
            rewards_N = rewards_N + cfg.reward.model_weight * scores
            rm_sum = scores.sum().item()
        if cfg.reward.overlong_buffer_len:
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            rewards_N = rewards_N + overlong_penalty(
                lengths,
                cfg.generator.max_new_tokens,
                cfg.reward.overlong_buffer_len,
                cfg.reward.overlong_penalty_factor,
            )
        return rewards_N, rm_sum

    def reward_model_scores(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """The reward model's score of each sequence [N], in micro-batches, in row order."""
        host = self.host
        assert self.reward_model is not None
        batch = build_sequence_batch(prompts, completions, host.tokenizer.pad_id).to(host.device)
        scores_N = torch.zeros(len(prompts))
        lengths = batch["length"].tolist()
        for rows in plan_micro_batches(lengths, self.config.training.micro_batch_tokens, host.dp_group):
            mb = trim_padding(batch[rows])
            scores_N[rows] = sequence_scores(self.reward_model, mb["tokens"], mb["length"]).cpu()
        return scores_N

"""Scored prompt groups (`Rollouts`): what a rollout collector hands the RL step, with what their
generation counted and the step metrics they report; `balance_groups` spreads them over the
data-parallel ranks by tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titanrl.distributed.balance import balance_units
from titanrl.generator import Completion
from titanrl.rewards.runner import RewardResult

if TYPE_CHECKING:
    from titanrl.components.timer import PhaseTimer
    from titanrl.rl.host import RolloutHost


@dataclass
class RolloutCounts:
    """What generating and scoring some rollouts counted on this rank (`RLStats.add_rollouts`
    sums them over ranks; decode steps, compile seconds and sampling rounds: their maximum)."""

    gen_tokens: int = 0
    """Prefill and decode tokens, greedy baseline rollouts included."""

    env_turns: int = 0
    """Turns: one per sample plus the resumed ones (multi-turn)."""

    env_failures: int = 0
    """Episodes whose environment failed (multi-turn)."""

    rm_score_sum: float = 0.0
    """The reward model's scores, summed."""

    decode_steps: int = 0
    """Decode steps of the generation (all sampling rounds)."""

    compile_s: float = 0.0
    """Seconds the generation spent compiling (a new batch bucket or prompt shape)."""

    sampling_rounds: int = 0
    """Dynamic sampling: rounds of generation this step; 0 without it."""

    dropped_groups: int = 0
    """Dynamic sampling: groups of equal rewards left out of training."""

    short_groups: int = 0
    """Dynamic sampling: dropped groups trained on (zero advantage) to fill the batch."""

    def __add__(self, other: RolloutCounts) -> RolloutCounts:
        return RolloutCounts(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )


@dataclass
class Rollouts:
    """Generated and scored samples of some prompts: G consecutive completions per prompt."""

    prompts: list[list[int]]
    completions: list[Completion]
    results: list[RewardResult]
    rewards: list[float]
    """Total reward per completion: weighted verifier + reward model + overlong penalty."""

    baseline_rewards: list[float] = field(default_factory=list)
    """Total reward of each prompt's greedy completion (baseline rollouts); empty otherwise."""

    counts: RolloutCounts = field(default_factory=RolloutCounts)
    """What the generation that made them counted; `concat` sums them, a `group` has none."""

    metrics: dict[str, float] = field(default_factory=dict)
    """Step metrics already reduced over the data-parallel ranks: `balance_groups`'s, then the
    collector's own (partial and one-step rollouts)."""

    lengths_by_rank: list[list[int]] | None = None
    """Every dp rank's response lengths, when `balance_groups` gathered them with its costs."""

    def group(self, i: int, G: int) -> Rollouts:
        return Rollouts(
            [self.prompts[i]],
            self.completions[i * G : (i + 1) * G],
            self.results[i * G : (i + 1) * G],
            self.rewards[i * G : (i + 1) * G],
            self.baseline_rewards[i : i + 1],
        )

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        counts = sum((p.counts for p in parts), RolloutCounts())
        return Rollouts(
            [x for p in parts for x in p.prompts],
            [x for p in parts for x in p.completions],
            [x for p in parts for x in p.results],
            [x for p in parts for x in p.rewards],
            [x for p in parts for x in p.baseline_rewards],
            counts,
        )

    def turn_scores(self, verifier_weight: float) -> list[list[float]]:
        """Multi-turn: each episode's per-turn rewards (weighted), with whatever else its total
        holds (reward model, length penalty) on the last turn, so that they sum to the total."""
        out = []
        for result, total in zip(self.results, self.rewards):
            scores = [verifier_weight * r for r in result.turn_rewards or [0.0]]
            scores[-1] += total - sum(scores)
            out.append(scores)
        return out

    def lengths(self) -> list[int]:
        """Each completion's response length."""
        return [len(c.token_ids) for c in self.completions]


def balance_groups(
    train: Rollouts, generated: Rollouts, host: RolloutHost, timer: PhaseTimer
) -> tuple[Rollouts, Rollouts]:
    """`train`'s groups spread over the trainer's dp ranks by tokens (training.balance_tokens):
    whole groups, each rank keeping at least one; and `generated` with the plan's metrics and
    every rank's response lengths, gathered in the same collective. Collective."""
    cfg, G = host.config, host.config.algorithm.group_size
    if not cfg.training.balance_tokens or host.dims.dp_size == 1 or cfg.algorithm.num_minibatches > 1:
        return train, generated
    with timer("balance"):
        assert len(train.completions) == G * len(train.prompts)
        groups = [train.group(i, G) for i in range(len(train.prompts))]
        costs = [sum(len(g.prompts[0]) + len(c.token_ids) for c in g.completions) for g in groups]
        out = balance_units(groups, costs, host.dp_group, rider=generated.lengths())
        balanced = train if out.units is None else Rollouts.concat(out.units)
    metrics = {
        "rank_tokens_imbalance_before": out.imbalance_before,
        "rank_tokens_imbalance": out.imbalance,
        "moved_groups": float(out.moved),
    }
    return balanced, dataclasses.replace(
        generated, metrics={**metrics, **generated.metrics}, lengths_by_rank=out.riders
    )

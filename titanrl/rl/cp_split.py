"""Rollouts under context parallelism: the cp ranks of a group load the same prompts, so each
generates and verifies only every cp-th prompt group (rank r: groups r, r + cp, ...) and one
all-gather over the cp group gives every cp rank the whole rollout, in the original prompt order.

Samples are seeded by global prompt ids (`RolloutCollector.rollout`), so the split draws the same
samples as one rank generating the whole batch; the generation counts are summed over the cp
ranks (decode steps and compile time: their maximum, as over data-parallel ranks), so the logged
statistics are those of a cp = 1 run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from titanrl.generator import Completion
from titanrl.rewards.runner import RewardResult

if TYPE_CHECKING:
    from titanrl.distributed import ParallelDims

Part = tuple[list[list[int]], list[Completion], list[RewardResult]]
"""(prompts, completions, verifier results) of some prompt groups; completions name their prompt
by its index in `prompts`."""


@dataclass
class RolloutShare:
    """Generated and verified samples of some prompts, before the reward model and the overlong
    shaping (which run on the whole rollout), with the generation counts that go in the stats."""

    prompts: list[list[int]]
    completions: list[Completion]
    results: list[RewardResult]
    greedy: Part | None = None
    """Baseline rollouts (one greedy completion per prompt) when the algorithm needs them."""

    gen_tokens: int = 0
    """Prefill and decode tokens of the sampled and the greedy generation."""

    env_turns: int = 0
    """Turns: one per sample plus the resumed ones (multi-turn)."""

    decode_steps: int = 0
    compile_s: float = 0.0

    @staticmethod
    def empty(baseline: bool) -> RolloutShare:
        """A cp rank with no prompt this round (fewer prompts than cp ranks): no generation."""
        return RolloutShare([], [], [], ([], [], []) if baseline else None)


@dataclass
class CPSplit:
    """This rank's place in its cp group, for the rollout split."""

    rank: int
    size: int
    group: Any

    def take(self, items: list) -> list:
        """This rank's share of a batch's prompt groups: r, r + cp, r + 2cp, ..."""
        return items[self.rank :: self.size]

    def gather(self, share: RolloutShare) -> RolloutShare:
        """Every cp rank's share, merged into the whole rollout (collective over the cp group)."""
        shares: list = [None] * self.size
        dist.all_gather_object(shares, share, group=self.group)
        return merge_shares(shares)


def cp_split(dims: ParallelDims | Any) -> CPSplit | None:
    """The cp split of `dims`; None without context parallelism (no collective then). A one-step
    rollout rank's host has no cp dimension: it generates its own batch whole."""
    if getattr(dims, "cp", 1) == 1:
        return None
    mesh = dims.cp_mesh
    return CPSplit(mesh.get_local_rank(), mesh.size(), mesh.get_group())


def merge_shares(shares: list[RolloutShare]) -> RolloutShare:
    """The shares of cp ranks 0 .. cp - 1 as one rollout: rank r's prompt j is prompt r + j * cp."""
    greedy = interleave([s.greedy for s in shares if s.greedy is not None]) if shares[0].greedy is not None else None
    return RolloutShare(
        *interleave([(s.prompts, s.completions, s.results) for s in shares]),
        greedy,
        gen_tokens=sum(s.gen_tokens for s in shares),
        env_turns=sum(s.env_turns for s in shares),
        decode_steps=max(s.decode_steps for s in shares),
        compile_s=max(s.compile_s for s in shares),
    )


def interleave(parts: list[Part]) -> Part:
    """Parts of cp ranks (rank r holding prompts r, r + cp, ...) in the global prompt order; each
    completion's `prompt_index` becomes its prompt's global index, its group's order kept."""
    cp = len(parts)
    groups: list[dict[int, list[tuple[Completion, RewardResult]]]] = [{} for _ in parts]
    for r, (_, completions, results) in enumerate(parts):
        assert len(completions) == len(results)
        for c, res in zip(completions, results):
            groups[r].setdefault(c.prompt_index, []).append((c, res))
    prompts, completions, results = [], [], []
    for g in range(sum(len(p[0]) for p in parts)):
        r, j = g % cp, g // cp
        prompts.append(parts[r][0][j])
        for c, res in groups[r].get(j, []):
            completions.append(dataclasses.replace(c, prompt_index=g))
            results.append(res)
    return prompts, completions, results

"""A user's own algorithms, outside titanrl: importable as 'helpers.plugin_algorithms:MaxBaseline'
(or ':PlainPG') with tests/ on PYTHONPATH. They are what a researcher writes to try an idea
without editing titanrl: the class, and a settings dataclass read from its own table
`[algorithm.<name>]`. MaxBaseline brings its own advantages, PlainPG its own policy term."""

import os
from dataclasses import dataclass

import torch

from titanrl.algorithms import AdvantageInputs, Advantages, Algorithm, LossInputs, PolicyTerm
from titanrl.algorithms.grpo import GRPO, GroupSettings


@dataclass
class MaxBaselineSettings:
    margin: float = 0.0
    """Subtracted from every advantage, so even a group's best sample is pushed down a little."""

    def validate(self) -> None:
        if self.margin < 0:
            raise ValueError(f"[algorithm.max_baseline] margin must be >= 0, got {self.margin}")


class MaxBaseline(Algorithm):
    """A pessimistic group baseline: A_i = r_i - max_j r_j - margin (every advantage <= 0),
    trained with the shared clipped surrogate."""

    name = "max_baseline"
    Settings = MaxBaselineSettings

    @classmethod
    def validate(cls, config, critic_algorithms: list[str]) -> None:
        super().validate(config, critic_algorithms)
        if config.algorithm.group_size < 2:
            raise ValueError("[algorithm] 'max_baseline' needs group_size >= 2 (a group's max is its baseline)")

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        r_PG = self.sequence_rewards(inputs).float().view(-1, self.config.group_size)
        advantages_N = (r_PG - r_PG.max(dim=1, keepdim=True).values).view(-1) - self.settings.margin
        # Tests ask each rank to record that it ran (no other way to see inside a torchrun job).
        log = os.environ.get("TITANRL_TEST_PLUGIN_LOG")
        if log:
            with open(f"{log}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(f"{advantages_N.numel()} {torch.all(advantages_N <= 0).item()} {self.settings.margin}\n")
        return Advantages(advantages_N)


@dataclass
class PlainPGSettings(GroupSettings):
    """`[algorithm.plain_pg]`: the ratio cap (and GRPO's normalize_std)."""

    max_ratio: float = 10.0
    """The importance ratio is capped here (no gradient above), so one stale token cannot dominate."""

    def validate(self) -> None:
        if not self.max_ratio > 1:
            raise ValueError(f"[algorithm.plain_pg] max_ratio must be > 1, got {self.max_ratio}")


class PlainPG(GRPO):
    """GRPO's advantages with a policy term of its own: the plain importance-weighted policy
    gradient L_t = -A_t * min(r_t, max_ratio), no trust region. Only `policy_term` is written;
    `Algorithm.loss` applies the off-policy importance weights, the KL term and the aggregation,
    as for every algorithm."""

    name = "plain_pg"
    Settings = PlainPGSettings
    dual_clip = False  # no clipped surrogate to cap

    def policy_term(self, inputs: LossInputs) -> PolicyTerm:
        ratio_BT = torch.exp(inputs.logprobs_BT - inputs.old_logprobs_BT)
        capped_BT = ratio_BT > self.settings.max_ratio
        return PolicyTerm(-inputs.advantages_BT * ratio_BT.clamp(max=self.settings.max_ratio), capped_BT)

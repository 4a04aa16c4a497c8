"""The algorithm interface: what an RL algorithm declares it needs and what it provides.

An algorithm is a small class: class attributes declare what the RL recipe must build or run
for it (a critic, a greedy baseline rollout), `advantages` turns scored rollouts into
advantages, `policy_term` turns logprobs and advantages into the per-token policy loss (which
`loss` weighs, adds the KL to and aggregates the same way for all), and `validate` rejects
configurations it cannot run. The RL recipe (`titanrl/recipes/rl_recipe.py`) reads only these; no
other module branches on an algorithm's name. Register a built-in in `algorithms/__init__.py`,
or load your own with `algorithm.name = "package.module:Class"`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from titanrl.algorithms.common import (
    LossInputs,
    LossOutput,
    LossSpec,
    PolicyTerm,
    clipped_term,
    kl_estimate,
    policy_loss,
)
from titanrl.config.manager import parse_table

if TYPE_CHECKING:  # the config imports nothing of ours at run time; only type hints need it
    from titanrl.config.algorithm import Algorithm as AlgorithmConfig
    from titanrl.config.job_config import JobConfig


@dataclass
class AdvantageInputs:
    """What an advantage estimator may use. N completions = P prompts x group_size, each
    group's samples consecutive and on one rank; [B, T] tensors are per next-token target."""

    rewards_N: torch.Tensor
    """Total reward of each completion (verifier, reward model, length shaping)."""

    mask_BT: torch.Tensor
    """1 on completion tokens that are trained on (not prompt, padding or environment tokens)."""

    kl_BT: torch.Tensor | None
    """Per-token KL to the reference when algorithm.kl_in_reward, else None."""

    values_BT: torch.Tensor | None
    """The critic's values (algorithms with `needs_critic`), else None."""

    turn_scores: list[list[float]] | None
    """Multi-turn episodes: each turn's reward (they sum to the total), else None."""

    baseline_rewards_P: torch.Tensor | None
    """Reward of each prompt's greedy completion (algorithms with `needs_baseline_rollout`)."""

    dp_group: dist.ProcessGroup | None
    """Data-parallel group, for statistics over the global batch (whitening)."""


@dataclass
class Advantages:
    advantages: torch.Tensor
    """Per sequence [B] or per token [B, T]."""

    returns_BT: torch.Tensor | None = None
    """The critic's regression targets (algorithms with `needs_critic`)."""


@dataclass
class NoSettings:
    """The settings of an algorithm that has none of its own."""


class Algorithm:
    """Base class: the clipped policy-gradient loss and the checks every algorithm shares.

    An algorithm with settings of its own declares them as a dataclass `Settings` (a docstring
    under each field, an optional `validate()`), read from the table `[algorithm.<name>]`; a
    subclass extends its parent's `Settings` by subclassing it."""

    name: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings
    needs_critic: ClassVar[bool] = False
    """The recipe trains a value model beside the policy and passes its values in."""

    needs_baseline_rollout: ClassVar[bool] = False
    """The recipe also generates one greedy completion per prompt and passes its reward in."""

    token_advantages: ClassVar[bool] = True
    """`policy_term` takes per-token advantages [B, T] as well as per-sequence ones [B] (what on-policy
    distillation's per-token advantages need)."""

    group_baseline: ClassVar[bool] = True
    """Advantages are relative to the sample's own group, so a group of equal rewards carries no
    signal (what makes DAPO's dynamic sampling meaningful)."""

    dual_clip: ClassVar[bool] = True
    """`policy_term` is the shared clipped surrogate, which `algorithm.dual_clip_c` caps; an
    algorithm with a policy term of its own sets False, and dual_clip_c > 0 is then rejected at load."""

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config
        self.settings = self.read_settings(config)

    @classmethod
    def read_settings(cls, config: AlgorithmConfig) -> Any:
        """This algorithm's `Settings` from `[algorithm.<name>]`: unknown keys get did-you-mean, a
        table written for another algorithm is an error (its settings would be silently unused)."""
        others = [name for name in config.tables if name != cls.name]
        if others:
            raise ValueError(
                f"[algorithm.{others[0]}] is set but algorithm.name is '{config.name}' (its settings table is "
                f"[algorithm.{cls.name}]): remove the table or change algorithm.name"
            )
        return parse_table(cls.Settings, config.tables.get(cls.name, {}), f"algorithm.{cls.name}")

    @classmethod
    def settings_table(cls, config: AlgorithmConfig) -> dict[str, Any]:
        """Every setting of this algorithm, defaults included, typed (what a resolved config records)."""
        return dataclasses.asdict(cls.read_settings(config))

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    @classmethod
    def validate(cls, config: JobConfig, critic_algorithms: list[str]) -> None:
        """Reject configurations this algorithm cannot run; `critic_algorithms` names the
        registered algorithms that use a critic (for the message)."""
        algo = config.algorithm
        cls.read_settings(algo)
        if cls.needs_critic and not config.critic.enable:
            raise ValueError(f"[algorithm] '{algo.name}' needs a value model: add [critic] with enable = true")
        if config.critic.enable and not cls.needs_critic:
            raise ValueError(
                f"[critic] enable = true, but algorithm '{algo.name}' uses no critic; use "
                + " or ".join(f"'{name}'" for name in critic_algorithms)
            )
        if algo.dual_clip_c > 0 and not cls.dual_clip:
            raise ValueError(
                f"[algorithm] dual_clip_c caps the clipped surrogate, which '{algo.name}' does not use: "
                "set dual_clip_c = 0"
            )
        if config.rollout.dynamic_sampling and not cls.group_baseline:
            raise ValueError(
                f"[rollout] dynamic_sampling drops groups with equal rewards, which only carry no signal "
                f"for group baselines, not for '{algo.name}'"
            )

    def advantages(self, inputs: AdvantageInputs) -> Advantages:
        raise NotImplementedError

    def sequence_rewards(self, inputs: AdvantageInputs) -> torch.Tensor:
        """Rewards with the sequence KL subtracted when the KL goes in the reward [N]."""
        if inputs.kl_BT is None:
            return inputs.rewards_N
        return inputs.rewards_N - self.config.kl_coef * inputs.kl_BT.sum(-1)

    def loss(self, inputs: LossInputs) -> LossOutput:
        """The policy loss of one micro-batch: this algorithm's `policy_term`, weighted by the
        off-policy importance weights, plus the KL term unless the KL is in the reward, aggregated
        as configured (`common.policy_loss`). Override `policy_term`, not this."""
        return policy_loss(self.policy_term(inputs), inputs, self.loss_spec())

    def policy_term(self, inputs: LossInputs) -> PolicyTerm:
        """The per-token policy loss: PPO's clipped surrogate (`common.clipped_term`), capped by
        `algorithm.dual_clip_c`. An algorithm with another objective overrides this (and sets
        `dual_clip = False`)."""
        c = self.config
        return clipped_term(inputs, c.clip_eps_low, c.clip_eps_high, c.dual_clip_c)

    def loss_spec(self) -> LossSpec:
        """Aggregation and KL term from `[algorithm]`: no KL term when the KL goes in the reward."""
        c = self.config
        kl_coef = c.kl_coef if not c.kl_in_reward else 0.0
        return LossSpec(c.loss_agg, c.loss_agg_norm, kl_coef, c.kl_estimator, c.kl_clamp)

    def kl(self, logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
        """Per-token KL to the reference with the configured estimator and clamp (what the recipe
        puts in the reward with `kl_in_reward`, and logs)."""
        return kl_estimate(logprobs_BT, ref_logprobs_BT, self.config.kl_estimator, self.config.kl_clamp)

"""The algorithm interface: what an RL algorithm declares it needs and what it provides.

An algorithm is a small class: class attributes declare what the RL recipe must build or run
for it (a critic, a greedy baseline rollout), `advantages` turns scored rollouts into
advantages, `loss` turns logprobs and advantages into the policy loss, and `validate` rejects
configurations it cannot run. The RL recipe (`titanrl/recipes/rl.py`) reads only these; no
other module branches on an algorithm's name. Register a built-in in `algorithms/__init__.py`,
or load your own with `algorithm.name = "package.module:Class"`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from titanrl.algorithms.common import LossOutput, clipped_pg_loss, kl_estimate
from titanrl.config.manager import parse_table

if TYPE_CHECKING:  # the config imports nothing of ours at run time; only type hints need it
    from titanrl.config.job_config import JobConfig
    from titanrl.config.rl_sections import Algorithm as AlgorithmConfig


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
    """`loss` takes per-token advantages [B, T] as well as per-sequence ones [B] (what on-policy
    distillation's per-token advantages need)."""

    group_baseline: ClassVar[bool] = True
    """Advantages are relative to the sample's own group, so a group of equal rewards carries no
    signal (what makes DAPO's dynamic sampling meaningful)."""

    dual_clip: ClassVar[bool] = True
    """`loss` is the shared clipped surrogate, which `algorithm.dual_clip_c` caps; an algorithm
    with a loss of its own sets False, and dual_clip_c > 0 is then rejected at load."""

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

    def loss(
        self,
        logprobs_BT: torch.Tensor,
        old_logprobs_BT: torch.Tensor,
        advantages: torch.Tensor,
        mask_BT: torch.Tensor,
        *,
        num_global_tokens: float,
        num_global_seqs: float,
        ref_logprobs_BT: torch.Tensor | None,
        is_weights_BT: torch.Tensor | None,
    ) -> LossOutput:
        """PPO's clipped surrogate (`common.clipped_pg_loss`), with the KL term unless the KL
        is in the reward; `is_weights_BT` are off-policy importance weights or None."""
        c = self.config
        return clipped_pg_loss(
            logprobs_BT,
            old_logprobs_BT,
            advantages,
            mask_BT,
            clip_low=c.clip_eps_low,
            clip_high=c.clip_eps_high,
            loss_agg=c.loss_agg,
            loss_agg_norm=c.loss_agg_norm,
            num_global_tokens=num_global_tokens,
            num_global_seqs=num_global_seqs,
            **self.kl_term(ref_logprobs_BT),
            is_weights_BT=is_weights_BT,
            dual_clip_c=c.dual_clip_c,
        )

    def kl_term(self, ref_logprobs_BT: torch.Tensor | None) -> dict:
        """The loss's KL arguments: none when the KL goes in the reward instead."""
        c = self.config
        if c.kl_coef > 0 and not c.kl_in_reward:
            return {
                "ref_logprobs_BT": ref_logprobs_BT,
                "kl_coef": c.kl_coef,
                "kl_estimator": c.kl_estimator,
                "kl_clamp": c.kl_clamp,
            }
        return {"ref_logprobs_BT": None, "kl_coef": 0.0, "kl_estimator": c.kl_estimator, "kl_clamp": c.kl_clamp}

    def kl(self, logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
        """Per-token KL to the reference with the configured estimator and clamp (what the recipe
        puts in the reward with `kl_in_reward`, and logs)."""
        return kl_estimate(logprobs_BT, ref_logprobs_BT, self.config.kl_estimator, self.config.kl_clamp)

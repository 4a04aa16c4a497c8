"""The algorithm registry: built-in algorithms by name, or a user's as 'package.module:Class'.

Adding a built-in is one file under `titanrl/algorithms/` (a subclass of `base.Algorithm`: its
`advantages` and, for a new objective, its `policy_term`) and one entry in `ALGORITHMS`.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from titanrl.algorithms.base import AdvantageInputs, Advantages, Algorithm, NoSettings
from titanrl.algorithms.cispo import CISPO
from titanrl.algorithms.common import LossInputs, LossOutput, PolicyTerm
from titanrl.algorithms.grpo import GRPO
from titanrl.algorithms.gspo import GSPO
from titanrl.algorithms.ppo import PPO
from titanrl.algorithms.reinforce_pp import ReinforcePP
from titanrl.algorithms.remax import ReMax
from titanrl.algorithms.rloo import RLOO
from titanrl.algorithms.sapo import SAPO
from titanrl.components.plugins import load_object

if TYPE_CHECKING:
    from titanrl.config.job_config import JobConfig

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (GRPO, RLOO, ReMax, ReinforcePP, GSPO, CISPO, SAPO, PPO)
}


def get_algorithm(name: str) -> type[Algorithm]:
    """The class registered as `name`, or the one `name` = 'package.module:Class' points to."""
    if ":" in name:
        cls = load_object(name, "algorithm.name")
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ValueError(f"algorithm.name '{name}' is not a subclass of titanrl.algorithms.base.Algorithm")
        return cls
    if name not in ALGORITHMS:
        close = difflib.get_close_matches(name, list(ALGORITHMS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"[algorithm] unknown name '{name}'; choose one of {', '.join(ALGORITHMS)} or your own "
            f"as 'package.module:Class'.{hint}"
        )
    return ALGORITHMS[name]


def validate_algorithm(config: JobConfig) -> None:
    """The configured algorithm's own checks (its settings table; what it needs: critic, group
    size, aggregation). Then its table holds every setting, typed, defaults included, and
    loss_agg_norm = 0 of 'seq-mean-token-sum-norm' is replaced by the maximum response length
    (`max_response_length`), so the resolved config (`to_toml`) records them."""
    critic_algorithms = [name for name, cls in ALGORITHMS.items() if cls.needs_critic]
    cls = get_algorithm(config.algorithm.name)
    cls.validate(config, critic_algorithms)
    config.algorithm.tables = {cls.name: cls.settings_table(config.algorithm)} if cls.Settings is not NoSettings else {}
    if config.algorithm.loss_agg == "seq-mean-token-sum-norm" and config.algorithm.loss_agg_norm == 0:
        config.algorithm.loss_agg_norm = max_response_length(config)


def max_response_length(config: JobConfig) -> int:
    """The most completion tokens of one sample: generator.max_new_tokens, or with an environment
    env.max_total_tokens (model and environment tokens of an episode). The constant C that
    loss_agg = 'seq-mean-token-sum-norm' divides by when loss_agg_norm is 0."""
    if config.agent.function:
        return config.agent.max_total_tokens
    return config.env.max_total_tokens if config.env.name else config.generator.max_new_tokens


__all__ = [
    "ALGORITHMS",
    "AdvantageInputs",
    "Advantages",
    "Algorithm",
    "LossInputs",
    "LossOutput",
    "PolicyTerm",
    "NoSettings",
    "get_algorithm",
    "max_response_length",
    "validate_algorithm",
]

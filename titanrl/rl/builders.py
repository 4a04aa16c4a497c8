"""What the RL recipe builds from the config: the rollout collector of `[rollout]`."""

from titanrl.config import JobConfig
from titanrl.rl.one_step import RemoteRolloutCollector
from titanrl.rl.partial import PartialRolloutCollector
from titanrl.rl.rollouts import RolloutCollector


def rollout_collector_class(config: JobConfig) -> type[RolloutCollector]:
    """The collector of `config.rollout`: colocated (synchronous or partial) or one-step."""
    if config.rollout.mode == "one_step":
        return RemoteRolloutCollector
    if config.rollout.partial:
        return PartialRolloutCollector
    return RolloutCollector

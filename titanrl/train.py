"""The titanrl entry point: every rank runs this file under torchrun.

    torchrun --nproc_per_node=N -m titanrl.train --job.config_file train_configs/X.toml [--section.key=value]

`job.recipe` picks what is trained ('rl', 'sft', 'dpo', 'reward_model'; `titanrl/recipes/`);
the `Trainer` (`titanrl/trainer.py`) builds everything and runs the loop.
"""

from titanrl.components import launch
from titanrl.components.async_rollouts import RolloutWorker, split_world
from titanrl.trainer import Trainer


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the job that the command line (`argv`, else sys.argv) describes; returns its first and
    last evaluation. A user error raises ValueError naming the cause and the fix."""
    config = launch.parse_args(argv)
    if config is None:  # --help
        return {}
    if config.rollout.mode == "one_step" and split_world(config).rollout:  # this rank only generates
        RolloutWorker(config).run()
        return {}
    trainer = Trainer(config)
    result = trainer.train()
    trainer.close()
    return result


if __name__ == "__main__":
    launch.run(main)

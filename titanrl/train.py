"""The titanrl entry point: every rank runs this file under torchrun.

    torchrun --nproc_per_node=N -m titanrl.train --job.config_file train_configs/X.toml [--section.key=value]

`job.recipe` picks what is trained ('rl', 'sft', 'dpo', 'reward_model'; `titanrl/recipes/`;
or a forked recipe: 'path/to/my_rl.py' or 'package.module:Class'); the `Trainer`
(`titanrl/trainer.py`) builds everything and runs the loop. `--help` lists every config key.
"""

from titanrl.algorithms import validate_algorithm
from titanrl.components import launch
from titanrl.config import JobConfig
from titanrl.recipes import get_recipe
from titanrl.rl.async_roles import split_async_world
from titanrl.rl.async_rollout import AsyncRolloutWorker
from titanrl.rl.one_step import split_world
from titanrl.rl.rollout_worker import RolloutWorker
from titanrl.trainer import Trainer


def build_trainer(config: JobConfig) -> Trainer:
    """The Trainer of the job's recipe (`job.recipe`), after the algorithm's own checks (which also
    resolve its settings table)."""
    validate_algorithm(config)
    return Trainer(config, get_recipe(config.job.recipe, config.job.config_file))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the job that the command line (`argv`, else sys.argv) describes; returns its first and
    last evaluation. A user error raises ValueError naming the cause and the fix."""
    config = launch.parse_args(argv)
    if config is None:  # --help
        return {}
    # First thing: a rank whose launcher dies while it starts up (in a rendezvous of the
    # disaggregated modes, say) must not live on as an orphan.
    launch.die_with_launcher()
    validate_algorithm(config)
    if config.rollout.mode == "one_step" and split_world(config).rollout:  # this rank only generates
        RolloutWorker(config).run()
        return {}
    if config.rollout.mode == "async" and split_async_world(config).rollout:  # this rank only generates
        AsyncRolloutWorker(config).run()
        return {}
    trainer = build_trainer(config)
    with launch.errors_logged(config.job.dump_folder):  # a user error mid-run: its traceback in a file
        result = trainer.train()
    trainer.close()
    return result


if __name__ == "__main__":
    launch.run(main)

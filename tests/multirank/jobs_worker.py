"""Several `titanrl.train` jobs, one after the other, in one torchrun launch.

Each job is the command line a test would give `torchrun -m titanrl.train` (`--jobs` names a
JSON file holding a list of them); every job runs through the rank entry point's own
`train.main`. One launch saves each further job the interpreter, torch and titanrl start-up of
every rank. The process group outlives each job (the next one joins it, as `init_distributed`
does when a group exists) and is left together after the last.
"""

import argparse
import gc
import json

import torch.distributed as dist

from titanrl import train
from titanrl.components import launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON file: a list of argument lists")
    with open(parser.parse_args().jobs) as f:
        jobs = json.load(f)
    leave = launch.shutdown
    # A job's `Trainer.close` leaves the process group; here the ranks only wait for each other.
    launch.shutdown = dist.barrier
    try:
        for argv in jobs:
            train.main(argv)
            gc.collect()  # as `launch.run` after a job: its model's groups freed now
    finally:
        launch.shutdown = leave
    leave()


if __name__ == "__main__":
    main()

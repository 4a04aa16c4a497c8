import os

import pytest
import torch
from helpers import background, checkpoint_runs
from helpers.launch import REPO_ROOT, run_cmd, run_torchrun, train_cmd  # noqa: F401  (fixtures use them)
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

# A job caches its compiled code under its dump folder (components/compile_cache.py): in the tests,
# a fresh tmp folder each, compiling from scratch. They share the machine's inductor cache instead.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
# One intra-op thread in the test process, as every rank has (OMP_NUM_THREADS=1). The suite's
# tensors are tiny, so a second OpenMP thread buys little; and the two cores are shared with the
# background lane's jobs and the ranks a test launches: two threads then wait for each other at
# every parallel op whenever one of them is descheduled, which multiplies a tiny-model test's time.
# A test that needs another count sets it and restores this one.
torch.set_num_threads(1)


background.register(
    "uninterrupted_two_ranks",
    ("tests/test_checkpoint.py", "tests/test_launch_hygiene.py"),
    lambda folder: train_cmd(checkpoint_runs.args(folder, 4, nproc=2), nproc=2),
)


@pytest.fixture(scope="session")
def uninterrupted_two_ranks():
    """The 4-step 2-rank RL run of helpers/checkpoint_runs.py's BASE, never interrupted: the
    reference of every kill / restart / SIGTERM test (shared, it is ~20 s; in the background
    from collection on, helpers/background.py)."""
    proc, folder = background.result("uninterrupted_two_ranks")
    checkpoint_runs.ok(proc)
    return folder


def pytest_collection_finish(session):
    """Start the subprocess jobs of the collected tests (helpers/background.py) right away."""
    background.start_for([item.nodeid for item in session.items])

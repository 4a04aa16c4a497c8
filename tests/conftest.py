import os

import pytest
from helpers.launch import REPO_ROOT, run_cmd, run_torchrun, train_cmd  # noqa: F401  (fixtures use them)
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

# A job caches its compiled code under its dump folder (components/compile_cache.py): in the tests,
# a fresh tmp folder each, compiling from scratch. They share the machine's inductor cache instead.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())


@pytest.fixture(scope="session")
def uninterrupted_two_ranks(tmp_path_factory):
    """The 4-step 2-rank RL run of helpers/checkpoint_runs.py's BASE, never interrupted: the
    reference of every kill / restart / SIGTERM test (shared, it is ~20 s)."""
    from helpers.checkpoint_runs import ok, run

    folder = tmp_path_factory.mktemp("full2")
    ok(run(folder, 4, nproc=2))
    return folder

"""Set-up shared by isolated worker processes (reward functions in `titanrl/rewards/worker.py`,
environments in `titanrl/envs/pool.py`). Imports nothing heavy: a worker that imports it starts
in the time the interpreter and the user's module take to import."""

import os
import signal

from titanrl.components.containment import set_memory_limit


def init_worker(memory_limit_mb: int) -> None:
    """Set up a fresh worker process: allow it `memory_limit_mb` more address space than it has
    after start-up (0: no limit), and make it die with its parent (the trainer, or its keeper).
    A worker in a cgroup of its own (`titanrl/components/containment.py`) also gets that much more
    resident memory for its whole tree, what it starts included.

    Call it after the user's code is imported, so the limit is what that code may allocate.
    PR_SET_PDEATHSIG fires when the *thread* that started the worker exits: workers are
    started from the trainer's main thread.
    """
    if memory_limit_mb > 0 and os.path.exists("/proc/self/statm"):
        import resource

        with open("/proc/self/statm") as f:
            size, resident = (int(n) * os.sysconf("SC_PAGE_SIZE") for n in f.read().split()[:2])
        limit = size + memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        set_memory_limit(resident + memory_limit_mb * 2**20)
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: workers then exit when their request pipe closes
        pass

"""Set-up shared by the isolated worker processes (reward functions in `titanrl/rewards/runner.py`,
environments in `titanrl/envs/pool.py`)."""

import os


def init_worker(memory_limit_mb: int, preload: object = None) -> None:
    """Set up a freshly spawned worker process: allow it `memory_limit_mb` more address space
    than it has after start-up (0: no limit), and make it die with its parent (the trainer).

    `preload` is ignored; it is there for a `ProcessPoolExecutor` initializer, whose arguments
    arrive unpickled: passing the user's function there imports its module before the limit is
    measured, so the limit is what the function itself may allocate.
    """
    del preload
    if memory_limit_mb > 0 and os.path.exists("/proc/self/statm"):
        import resource

        with open("/proc/self/statm") as f:
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = current + memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: workers then exit when their call queue closes
        pass

"""Per-phase watchdog: a phase that runs past its timeout ends the process and says where.

A hung collective or reward call otherwise blocks every rank forever. Exiting (code 3) lets
torchrun tear the job down, and `--max-restarts` or a re-run resumes from the last checkpoint.
"""

import contextlib
import faulthandler
import os
import sys
import threading


class Watchdog:
    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.timeout_s <= 0:
            yield
            return
        timer = threading.Timer(self.timeout_s, self._fire, args=(name,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _fire(self, name: str) -> None:
        sys.stderr.write(
            f"titanrl watchdog: rank {self.rank} stuck in phase '{name}' for more than {self.timeout_s:g} s "
            "(job.phase_timeout_s); stacks follow, exiting\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)

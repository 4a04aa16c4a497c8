"""Per-phase wall time and memory of a step, each phase under the watchdog."""

import contextlib
import os
import resource
import time
from collections import defaultdict

import torch

from titanrl.components.watchdog import Watchdog


class PhaseTimer:
    """Times each phase of a step, under the watchdog, and its memory: on CUDA the peak allocated
    during the phase; on CPU the process's resident memory when the phase ends."""

    def __init__(self, watchdog: Watchdog, device: torch.device) -> None:
        self.watchdog, self.device = watchdog, device
        self.seconds: dict[str, float] = defaultdict(float)
        self.memory_gb: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.watchdog.phase(phase):
            yield
        self.seconds[phase] += time.perf_counter() - start
        self.memory_gb[phase] = max(self.memory_gb[phase], phase_memory_gb(self.device))

    def metrics(self) -> dict[str, float]:
        """time_<phase>, mem_<phase>_gb and the step's peak memory."""
        # On CUDA each phase resets the peak counter, so the step's peak is the phases' max.
        peak = max(self.memory_gb.values()) if self.device.type == "cuda" else peak_memory_gb(self.device)
        return {
            **{f"time_{k}": v for k, v in self.seconds.items()},
            **{f"mem_{k}_gb": v for k, v in self.memory_gb.items()},
            "peak_mem_gb": peak,
        }


def phase_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

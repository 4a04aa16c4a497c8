"""Per-phase wall time and memory of a step, each phase under the watchdog and shown in profiler
traces as a range named after it ([profiling])."""

import contextlib
import os
import resource
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from titanrl.components.watchdog import Watchdog


@contextlib.contextmanager
def phase(watchdog: Watchdog, name: str):
    """A phase the watchdog guards, and a `torch.profiler.record_function` range named `name`
    (sync, generate, reward, balance, logprob, train, eval, checkpoint) in a profiler trace."""
    with watchdog.phase(name), torch.profiler.record_function(name):
        yield


class PhaseTimer:
    """Times each phase of a step, under the watchdog, and its memory: on CUDA the peak allocated
    during the phase; on CPU the process's resident memory when the phase ends."""

    def __init__(self, watchdog: Watchdog, device: torch.device) -> None:
        self.watchdog, self.device = watchdog, device
        self.seconds: dict[str, float] = defaultdict(float)
        self.memory_gb: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with phase(self.watchdog, name):
            yield
        self.seconds[name] += time.perf_counter() - start
        self.memory_gb[name] = max(self.memory_gb[name], phase_memory_gb(self.device))

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


def straggler_metrics(phase_seconds: dict[str, float], min_excess_s: float = 0.0) -> dict[str, float | str]:
    """Which rank held the others back this step (collective: every rank calls it with the same
    phases, in the order they ran).

    The ranks wait for the slowest one at their next collective, so the waiting shows up in a
    later phase of the *other* ranks; the phase where the ranks first drift apart by at least
    half the largest spread is where the straggler spent its time. Returns straggler_rank,
    straggler_phase and straggler_excess_s (its time in that phase minus the fastest rank's),
    or nothing on one rank or when no phase differs by more than `min_excess_s`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or not phase_seconds:
        return {}
    local = torch.tensor(list(phase_seconds.values()), dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    by_rank_RP = torch.stack(gathered)
    spread_P = by_rank_RP.max(dim=0).values - by_rank_RP.min(dim=0).values
    if spread_P.max().item() <= min_excess_s:
        return {}
    first = int(torch.nonzero(spread_P >= spread_P.max() / 2)[0].item())
    return {
        "straggler_rank": int(by_rank_RP[:, first].argmax().item()),
        "straggler_phase": list(phase_seconds)[first],
        "straggler_excess_s": spread_P[first].item(),
    }

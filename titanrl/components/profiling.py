"""Profiling ([profiling]): `torch.profiler` traces and memory snapshots of every
`profile_freq`-th step, one file per rank, under job.dump_folder:

    <save_traces_folder>/iteration_<step>/rank<r>_trace.json                    Chrome trace
    <save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle  (CUDA)
    <save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory.json          (CPU: peak RSS)

The Trainer enters both context managers around its step loop and calls `.step()` on what they
yield after every training step. The phases of a step (sync, generate, reward, logprob, train,
eval, checkpoint) appear in a trace as `record_function` ranges opened by
`titanrl.components.timer.phase`.
"""

import contextlib
import json
import os
import pickle
import resource
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity

from titanrl.components.console import get_logger
from titanrl.config.run import Profiling

log = get_logger(__name__)

# Allocation events kept by `torch.cuda.memory._record_memory_history` (a ring buffer).
MEMORY_HISTORY_MAX_ENTRIES = 100_000


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _iteration_folder(dump_folder: str, folder: str, name: str) -> str:
    path = os.path.join(dump_folder, folder, name)
    os.makedirs(path, exist_ok=True)
    return path


def profiler_action(config: Profiling, step: int) -> ProfilerAction:
    """What the profiler does during training step `step` (1-based): each cycle of profile_freq
    steps ends with profiler_active recorded steps, after profiler_warmup warm-up steps; the
    trace is saved after step profile_freq, 2 x profile_freq ..."""
    position = (step - 1) % config.profile_freq + 1  # 1 .. profile_freq
    first_recorded = config.profile_freq - config.profiler_active + 1
    if position == config.profile_freq:
        return ProfilerAction.RECORD_AND_SAVE
    if position >= first_recorded:
        return ProfilerAction.RECORD
    if position >= first_recorded - config.profiler_warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


@contextlib.contextmanager
def maybe_enable_profiling(
    config: Profiling, dump_folder: str, global_step: int
) -> Iterator[torch.profiler.profile | None]:
    """A started `torch.profiler.profile` when profiling is enabled, else None. `global_step` is
    the last step already done (0 on a fresh run, the checkpoint's step on resume); call
    `.step()` after each training step."""
    if not config.enable_profiling:
        yield None
        return
    rank = _rank()
    suffix = ".json.gz" if config.gzip_traces else ".json"
    exiting = False

    def write_trace(prof: torch.profiler.profile) -> None:
        # step() counts the step it ends before saving, so global_step + step_num is that step. A
        # run that ends inside a recording window saves what it has on exit, as <last step>_exit.
        step = global_step + prof.step_num
        name = f"iteration_{step}_exit" if exiting else f"iteration_{step}"
        folder = _iteration_folder(dump_folder, config.save_traces_folder, name)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace{suffix}"))

    def schedule(step_num: int) -> ProfilerAction:
        # The profiler counts its own steps from 0, i.e. from training step global_step + 1.
        return profiler_action(config, global_step + 1 + step_num)

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        # One trace per cycle is the point; torch warns that events do not accumulate across cycles.
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        with torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=write_trace, record_shapes=True
        ) as prof:
            try:
                yield prof
            finally:
                exiting = True


class MemorySnapshot:
    """Writes this rank's memory at every profile_freq-th step (`step()`) and on demand (`dump`):
    on CUDA the allocator's snapshot with the recorded allocation history, on CPU the process's
    peak resident memory."""

    def __init__(self, config: Profiling, dump_folder: str, global_step: int, device: torch.device) -> None:
        self.config, self.dump_folder, self.device = config, dump_folder, device
        self.last_step = global_step
        self.rank = _rank()

    def step(self) -> None:
        """Call after each training step."""
        self.last_step += 1
        if self.last_step % self.config.profile_freq == 0:
            self.dump(self.last_step)

    def dump(self, step: int, suffix: str = "") -> str:
        """Write the snapshot of (or during) `step` to iteration_<step><suffix>/; returns its path."""
        folder = _iteration_folder(
            self.dump_folder, self.config.save_memory_snapshot_folder, f"iteration_{step}{suffix}"
        )
        if self.device.type == "cuda":
            path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            return path
        path = os.path.join(folder, f"rank{self.rank}_memory.json")
        max_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        with open(path, "w") as f:
            json.dump({"step": step, "rank": self.rank, "max_rss_gb": max_rss_gb}, f)
        return path


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    config: Profiling, dump_folder: str, global_step: int, device: torch.device
) -> Iterator[MemorySnapshot | None]:
    """A `MemorySnapshot` when enabled, else None; on CUDA, records the allocation history while
    open. A step that runs out of memory dumps iteration_<step>_oom/ before the error goes on."""
    if not config.enable_memory_snapshot:
        yield None
        return
    snapshot = MemorySnapshot(config, dump_folder, global_step, device)
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
    try:
        yield snapshot
    except torch.OutOfMemoryError:
        path = snapshot.dump(snapshot.last_step + 1, "_oom")
        log.error(
            f"titanrl: rank {snapshot.rank} ran out of memory in step {snapshot.last_step + 1}; "
            f"memory snapshot written to {path}"
        )
        raise
    finally:
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)

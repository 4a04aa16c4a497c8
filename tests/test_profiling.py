"""[profiling]: a profiled RL run writes a Chrome trace of the traced step with every phase of
the step as a named range, and a memory record; the profiler's schedule; nothing is written when
profiling is off; bad values are errors that name the key."""

import gzip
import json
import os

import pytest
import torch
from helpers.launch import REPO_ROOT
from helpers.tiny import smoke_run_args
from torch.profiler import ProfilerAction

from titanrl import train
from titanrl.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling, profiler_action
from titanrl.config import load_config
from titanrl.config.run import Profiling

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
TINY = smoke_run_args(steps=None, sft_steps=0, batch_size=2, group_size=2, max_new_tokens=4, eval_samples=2)
# The phases of an RL step as PhaseTimer names them, the Trainer's evaluation of the last step,
# and the generator's own ranges.
PHASES = {
    "sync",
    "generate",
    "reward",
    "logprob",
    "train",
    "eval",
    "generator/prefill",
    "generator/decode",
    "generator/sample",
}


def _annotations(trace_path: str) -> set[str]:
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("cat") == "user_annotation"}


def test_profiled_rl_run_traces_every_phase_of_the_traced_step(tmp_path):
    train.main(
        [
            *TINY,
            "--training.steps=2",
            f"--job.dump_folder={tmp_path}",
            "--profiling.enable_profiling=true",
            "--profiling.profile_freq=2",
            "--profiling.profiler_warmup=1",
            "--profiling.enable_memory_snapshot=true",
        ]
    )
    traces = tmp_path / "profile_traces"
    assert sorted(os.listdir(traces)) == ["iteration_2"]  # step 1 warms the profiler up, unrecorded
    assert sorted(os.listdir(traces / "iteration_2")) == ["rank0_trace.json"]
    names = _annotations(str(traces / "iteration_2" / "rank0_trace.json"))
    missing = PHASES - names
    assert not missing, f"ranges missing from the trace: {missing}; it has {sorted(names)}"
    with open(tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory.json") as f:
        memory = json.load(f)
    assert memory["step"] == 2 and memory["rank"] == 0 and memory["max_rss_gb"] > 0.01


def test_profiling_off_writes_nothing(tmp_path):
    train.main([*TINY, "--training.steps=1", f"--job.dump_folder={tmp_path}"])
    assert os.path.exists(tmp_path / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "profile_traces")
    assert not os.path.exists(tmp_path / "memory_snapshot")


def test_schedule_ends_every_cycle_with_the_active_steps():
    config = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2)
    cycle = [ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE]
    assert [profiler_action(config, step) for step in range(1, 9)] == cycle * 2


def test_resumed_run_traces_the_same_steps_as_a_fresh_one(tmp_path):
    """After a resume at step 3 the traced step is still step 4 (profile_freq 2), gzipped here."""
    config = Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=0, gzip_traces=True)
    with maybe_enable_profiling(config, str(tmp_path), global_step=3) as prof:
        for _ in range(3):  # steps 4, 5, 6
            with torch.profiler.record_function("train"):
                torch.ones(4).add_(1)
            prof.step()
    assert sorted(os.listdir(tmp_path / "profile_traces")) == ["iteration_4", "iteration_6"]
    assert "train" in _annotations(str(tmp_path / "profile_traces" / "iteration_4" / "rank0_trace.json.gz"))


def test_run_ending_inside_a_recording_window_saves_it_as_exit(tmp_path):
    config = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=0, profiler_active=2)
    with maybe_enable_profiling(config, str(tmp_path), global_step=0) as prof:
        for _ in range(2):  # step 1 unrecorded, step 2 recorded, the run ends before step 3 saves
            with torch.profiler.record_function("train"):
                torch.ones(4).add_(1)
            prof.step()
    assert os.listdir(tmp_path / "profile_traces") == ["iteration_2_exit"]
    assert "train" in _annotations(str(tmp_path / "profile_traces" / "iteration_2_exit" / "rank0_trace.json"))


def test_out_of_memory_dumps_a_snapshot_and_raises(tmp_path):
    config = Profiling(enable_memory_snapshot=True, profile_freq=10)
    with pytest.raises(torch.OutOfMemoryError):
        with maybe_enable_memory_snapshot(config, str(tmp_path), 0, torch.device("cpu")) as memory:
            memory.step()  # step 1: not a multiple of profile_freq, nothing written
            raise torch.OutOfMemoryError("step 2 ran out of memory")
    assert os.listdir(tmp_path / "memory_snapshot") == ["iteration_2_oom"]
    with open(tmp_path / "memory_snapshot" / "iteration_2_oom" / "rank0_memory.json") as f:
        assert json.load(f)["step"] == 2


@pytest.mark.parametrize(
    "args, key",
    [
        (["--profiling.profile_freq=0"], "profile_freq"),
        (["--profiling.profiler_active=0"], "profiler_active"),
        (["--profiling.profiler_warmup=-1"], "profiler_warmup"),
        (["--profiling.enable_profiling=true", "--profiling.profile_freq=2"], "profiler_warmup"),
        (["--profiling.save_traces_folder="], "save_traces_folder"),
        (["--profiling.profile_freq=ten"], "profiling.profile_freq"),
        (["--profiling.profile_frequency=2"], "profiling.profile_frequency"),
    ],
)
def test_bad_profiling_values_name_the_key(args, key):
    with pytest.raises(ValueError, match=key):
        load_config(args)

"""Asynchronous RL (`rollout.mode = "async"`): rollout ranks decode one endless stream, trainer
ranks train the next batch within `rollout.max_staleness` versions, weights are broadcast in
buckets and swapped in mid-decode (`rl/async_*.py`; the stream itself: test_async_stream.py)."""

import json
import os
import sys

import pytest
import torch
from helpers import background
from helpers.launch import run_cmd, torchrun_cmd, train_cmd
from helpers.tiny import smoke_run_args


def _args(folder, *extra, steps=4):
    return smoke_run_args(f"--job.dump_folder={folder}", *extra, steps=steps, sft_steps=3)


def _launched(name):
    """The dump folder of a background run (helpers/background.py), after it exited 0."""
    proc, folder = background.result(name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


K0 = "tests/test_async.py::test_async_with_staleness_0_on_1_plus_1_ranks_is_the_synchronous_run"
K2 = "tests/test_async.py::test_async_staleness_2_on_2_plus_2_ranks_never_trains_a_token_more_than_2_versions_stale"
ASYNC = ["--rollout.mode=async", "--algorithm.off_policy_correction=tis"]
# The fixed runs, in the background from collection on: the synchronous reference and async k = 0
# (1 + 1 ranks), and async k = 2 with a tp = 2 rollout group and 2 FSDP2 trainer ranks.
# The reference under torchrun too: its one rank's process group is the trainer ranks' own.
background.register("async_sync_ref", (K0,), lambda folder: [*torchrun_cmd(1), "-m", "titanrl.train", *_args(folder)])
background.register(
    "async_k0", (K0,), lambda folder: train_cmd(_args(folder, "--rollout.mode=async", "--rollout.max_staleness=0"), 2)
)
background.register(
    "async_k2_tp",
    (K2,),
    lambda folder: train_cmd(
        _args(
            folder,
            *ASYNC,
            "--rollout.max_staleness=2",
            "--rollout.rollout_ranks=2",
            "--rollout.tp=2",
            "--parallelism.dp_shard=-1",
            steps=6,
        ),
        4,
    ),
)


def _run_ok(args, nproc):
    proc = run_cmd(train_cmd(args, nproc), {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rl_steps(folder) -> dict[int, dict]:
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    return {r["step"]: r for r in rows if r.get("phase") == "rl" and "reward_mean" in r}


def _groups(folder) -> list[dict]:
    return [json.loads(line) for line in open(folder / "async_groups.jsonl")]


TIMING = ("time", "_s", "tokens_per_s", "eta", "mem_")
"""Keys of wall time, throughput and memory (a rank that also decodes holds more): not compared."""


def _non_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


@pytest.mark.multirank
def test_async_with_staleness_0_on_1_plus_1_ranks_is_the_synchronous_run():
    """rollout.mode = 'async', max_staleness = 0, 1 rollout + 1 trainer rank -> every non-timing
    metric both runs log equals the synchronous 1-rank run's to the last digit"""
    sync, k0 = _launched("async_sync_ref"), _launched("async_k0")
    a, b = _rl_steps(k0), _rl_steps(sync)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and any(b[s]["grad_norm"] > 0 for s in b)
    for s in a:
        shared = set(_non_timing(a[s])) & set(_non_timing(b[s]))
        assert len(shared) >= 18
        assert {k: a[s][k] for k in shared} == {k: b[s][k] for k in shared}, s
    assert all(a[s]["version_lag_max"] == 0 and a[s]["groups_dropped"] == 0 for s in a)
    assert [g["gid"] for g in _groups(k0)] == list(range(16))


@pytest.mark.multirank
def test_async_staleness_2_on_2_plus_2_ranks_never_trains_a_token_more_than_2_versions_stale():
    """rollout.mode = 'async', max_staleness = 2, one generator tp-sharded over 2 rollout ranks (rollout.tp = 2) + 2 FSDP2 trainer ranks -> the recorded versions of every trained group are within 2 of the weights it was trained from, the bound is reached, nothing is dropped, every group is trained once; step 1's samples (version 0) score as the trainer's forward does (the tp shards took the right slices of the broadcast weights)"""
    folder = _launched("async_k2_tp")
    rows, steps = _groups(folder), _rl_steps(folder)
    assert steps[1]["gen_logprob_diff"] < 1e-5 < steps[2]["gen_logprob_diff"]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and len(rows) == 6 * 4
    assert all(0 <= (r["step"] - 1) - r["min_version"] <= 2 for r in rows)
    assert all(r["min_version"] <= r["max_version"] <= r["step"] - 1 for r in rows)
    assert max((r["step"] - 1) - r["min_version"] for r in rows) == 2  # the rollout rank ran ahead
    assert len({r["gid"] for r in rows}) == len(rows)
    assert all(steps[s]["version_lag_max"] <= 2 and steps[s]["groups_dropped"] == 0 for s in steps)
    assert all(abs(sum(steps[s][f"stale_tokens_{d}"] for d in range(3)) - 1) < 1e-9 for s in steps)


@pytest.mark.multirank
def test_async_kill_9_and_resume_trains_every_group_once(tmp_path):
    """rollout.mode = 'async' (max_staleness 2), kill -9 of the trainer after step 3, the same command again -> resumes from step-2 with the groups the hub had queued (saved in its checkpoint); no group is lost or trained twice, every trained token stays within 2 versions"""
    extra = [
        "--rollout.mode=async",
        "--rollout.max_staleness=2",
        "--algorithm.off_policy_correction=tis",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANRL_FAULT": "step:3:0"}
    crashed = run_cmd(train_cmd(_args(tmp_path, *extra, steps=5), 2), env)
    assert crashed.returncode != 0
    before = _groups(tmp_path)
    assert {r["step"] for r in before} == {1, 2, 3}
    host = torch.load(tmp_path / "checkpoint" / "step-2" / "host_rank0.pt", weights_only=True)  # plain data
    queued = {g["gid"] for g in host["recipe"]["queued"]}
    assert queued, "nothing was queued at the checkpoint: the test would not exercise restoring it"
    out = _run_ok(_args(tmp_path, *extra, steps=5), 2)
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    rows = _groups(tmp_path)[len(before) :]  # the resumed run's: steps 3, 4, 5
    assert {r["step"] for r in rows} == {3, 4, 5}
    first = [r["gid"] for r in before if r["step"] <= 2]
    trained = first + [r["gid"] for r in rows]
    assert len(trained) == len(set(trained)) == 5 * 4  # none twice
    assert queued <= {r["gid"] for r in rows}  # the queued groups were trained, not lost
    # Nothing skipped: every group of the stream before the last trained one is trained or was
    # still in flight at the end (at most k + 1 batches ahead of the trainer).
    missing = set(range(max(trained))) - set(trained)
    assert len(missing) <= 3 * 4
    assert all(0 <= (r["step"] - 1) - r["min_version"] <= 2 for r in rows)


DEAD = "tests/test_async.py::test_a_dead_rollout_rank_stops_the_run_with_one_line_naming_it"


def _dead_rollout_cmd(folder):
    args = _args(folder, "--rollout.mode=async", "--rollout.max_staleness=1", "--algorithm.off_policy_correction=tis")
    config, rest = args[0].split("=", 1)[1], args[1:]
    return [sys.executable, "-m", "titanrl.cli", "run", "--nproc", "2", config, *rest]


# In the background lane too: one `titanrl run` whose rollout rank kills itself as it takes version 2.
background.register("async_dead_rollout", (DEAD,), _dead_rollout_cmd, env={"TITANRL_FAULT": "rollout_swap:2:0"})


@pytest.mark.multirank
def test_a_dead_rollout_rank_stops_the_run_with_one_line_naming_it():
    """rollout.mode = 'async': kill -9 of the rollout rank mid-run (as it takes version 2) -> `titanrl run` stops every rank and names it in one line (rollout rank 0, SIGKILL); no hang"""
    proc, folder = background.result("async_dead_rollout", timeout_s=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "titanrl: rank 0 (rollout rank 0) was killed by SIGKILL; the other ranks were stopped" in proc.stderr
    assert len(_rl_steps(folder)) < 4


def test_the_hub_takes_the_oldest_groups_and_drops_those_past_the_bound():
    """GroupQueue.take (the hub's batch): once every rollout group has the version, the n oldest
    groups within k versions (by oldest token, then arrival) are trained; older ones are dropped
    (rollout.stale_groups = 'drop' lets them happen) and their ids returned to be skipped"""
    from titanrl.rl.async_collector import GroupQueue

    queue = GroupQueue(num_groups=1)
    versions = [5, 3, 4, 1, 4, 2, 5]
    queue.groups = [{"gid": i, "min_version": v, "arrival": i} for i, v in enumerate(versions)]
    queue.swapped = [5]
    picked, dropped = queue.take(version=5, n=3, k=1)
    assert [g["gid"] for g in picked] == [2, 4, 0]  # version 4 (by arrival), then 5
    assert sorted(dropped) == [1, 3, 5]  # versions 3, 1, 2: more than 1 behind 5
    assert [g["gid"] for g in queue.groups] == [6]

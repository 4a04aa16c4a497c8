"""Checkpoints across world sizes and placements, async saves, and saves that cannot write.

Resharding runs the SFT recipe on the debug model: its data is fixed, so a resumed run's per-step
losses can be compared with those of a run that never changed world size. (RL would do, too:
sampling is seeded per sample. But a 1e-7 difference in logits can flip a sampled token and with
it a reward, a discrete jump that says nothing about the checkpoint; and SFT starts faster.)
Each docstring '<situation> -> <observed behaviour>' is a row of the table in docs/reliability.md.

Run as a script, this file is also the worker of its multi-rank and kill -9 tests.
"""

import contextlib
import errno
import json
import os
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers.launch import REPO_ROOT, run_cmd, run_torchrun, run_train_jobs, train_cmd, train_here
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

from titanrl.components.checkpoint import CheckpointManager, CheckpointSaveError

CONFIG = os.path.join(REPO_ROOT, "train_configs", "sft_reverse_debug.toml")
STEPS = 5
# A checkpoint every step, all kept: any of them can be resumed from elsewhere.
BASE = [
    f"--job.config_file={CONFIG}",
    f"--training.steps={STEPS}",
    "--training.batch_size=8",
    "--data.num_eval_samples=8",
    "--metrics.eval_freq=0",
    "--metrics.log_freq=1",
    "--lr_scheduler.warmup_steps=1",
    "--checkpoint.interval=1",
    "--checkpoint.keep_latest_k=0",
    "--checkpoint.export_hf=false",
]
# Runs on 1, 2 and 4 ranks sum in different orders (FSDP's reduce-scatter, TP's all-reduce), so
# a resumed run is not bitwise equal to one that never changed world size. Measured on these
# runs (2 cores, gloo): losses within 2.2e-7 relative, gradient norms within 9.3e-7, the same as
# a 2-rank run from scratch against the 1-rank one (1.1e-7, 9.3e-7): float32 rounding. A resume
# that went wrong is far outside 1e-5 (measured on the same runs): a data loader restarted from
# its beginning is 4.4e-2 off at the first resumed step, a lost AdamW state 3.5e-2 at the second.
# The learning rate is host arithmetic on the restored scheduler: exact.
RTOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(folder, nproc=1, extra=()):
    args = [*BASE, f"--job.dump_folder={folder}", *extra]
    cmd = train_cmd(args, nproc)
    proc = run_cmd(cmd, ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_here(folder, extra=()) -> str:
    """`_train` on 1 rank, in this process (no interpreter start-up): what it printed."""
    return train_here([*BASE, f"--job.dump_folder={folder}", *extra])


def _resume(folder, source_step_dir, nproc, extra=()):
    """Continue `source_step_dir` (another run's checkpoint) into `folder`."""
    load = [f"--checkpoint.load_path={source_step_dir}", *extra]
    stdout = _train_here(folder, load) if nproc == 1 else _train(folder, nproc, load).stdout
    assert f"resumed from {source_step_dir}" in stdout
    return folder


def _steps(folder) -> dict[int, dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def _assert_close(resumed, reference, steps):
    got, want = _steps(resumed), _steps(reference)
    assert sorted(got) == list(steps)
    for s in steps:
        assert got[s]["lr"] == want[s]["lr"], s
        for key in ("loss", "grad_norm"):
            assert got[s][key] == pytest.approx(want[s][key], rel=RTOL), (s, key)
    assert got[STEPS]["eval_loss"] == pytest.approx(want[STEPS]["eval_loss"], rel=RTOL)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The run that never changes world size: 1 rank, a checkpoint after every step."""
    folder = tmp_path_factory.mktemp("one_rank")
    _train_here(folder)
    return folder


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory):
    """`one_rank`'s step-2 checkpoint continued on 2 ranks with FSDP (dp_shard=2) and with tensor
    parallelism (tp=2), both jobs in one launch: {"fsdp": folder, "tp": folder}."""
    step2 = one_rank / "checkpoint" / "step-2"
    layouts = {"fsdp": ["--parallelism.dp_shard=2"], "tp": ["--parallelism.tp=2"]}
    folders = {name: tmp_path_factory.mktemp(f"{name}_two") for name in layouts}
    jobs = [
        [*BASE, f"--job.dump_folder={folders[name]}", f"--checkpoint.load_path={step2}", *layout]
        for name, layout in layouts.items()
    ]
    output = run_train_jobs(jobs, 2, tmp_path_factory.mktemp("jobs"))
    assert output.count(f"resumed from {step2}") == len(jobs), output[-3000:]
    return folders


@pytest.fixture(scope="module")
def fsdp_two(two_ranks):
    return two_ranks["fsdp"]


@pytest.mark.multirank
def test_one_rank_checkpoint_resumes_on_two_fsdp_ranks(one_rank, fsdp_two):
    """Checkpoint saved on 1 rank, resumed on 2 ranks with FSDP (dp_shard=2) -> every later step's loss and gradient norm within 1e-5 relative of a run that never changed world size; learning rate exact"""
    _assert_close(fsdp_two, one_rank, [3, 4, 5])


@pytest.mark.multirank
def test_one_rank_checkpoint_resumes_on_two_tp_ranks(one_rank, two_ranks):
    """Checkpoint saved on 1 rank, resumed on 2 ranks with tensor parallelism (tp=2) -> every later step's loss and gradient norm within 1e-5 relative of a run that never changed world size"""
    _assert_close(two_ranks["tp"], one_rank, [3, 4, 5])


@pytest.mark.multirank
def test_two_rank_checkpoint_resumes_on_one_rank(one_rank, fsdp_two, tmp_path):
    """Checkpoint saved on 2 FSDP ranks (itself resumed from 1 rank), resumed on 1 rank -> the round trip from 1 rank to 2 and back ends within 1e-5 relative of a run that never changed world size"""
    _assert_close(_resume(tmp_path, fsdp_two / "checkpoint" / "step-3", 1), one_rank, [4, 5])


@pytest.mark.multirank
def test_one_rank_checkpoint_resumes_on_four_ranks_fsdp_and_tp(one_rank, tmp_path):
    """Checkpoint saved on 1 rank, resumed on 4 ranks (dp_shard=2 x tp=2) -> every later step within 1e-5 relative of a run that never changed world size"""
    _assert_close(
        _resume(tmp_path, one_rank / "checkpoint" / "step-2", 4, ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
        one_rank,
        [3, 4, 5],
    )


@pytest.mark.multirank
def test_host_state_does_not_depend_on_rank_or_world_size(one_rank, fsdp_two):
    """Host state (data position, LR schedule) of a 2-rank checkpoint -> the same on both ranks and as a 1-rank run's at that step, so a rank that did not exist at save time resumes from rank 0's file"""

    def host(folder, rank):
        return torch.load(folder / "checkpoint" / "step-4" / f"host_rank{rank}.pt", weights_only=False)

    want = host(one_rank, 0)
    for rank in (0, 1):
        got = host(fsdp_two, rank)
        # 'root' is the position in the sample stream; torchdata's own 'num_yielded' counter also
        # counts the batch it looks ahead at after a restore, and no position is read from it.
        assert got["loader"]["root"] == want["loader"]["root"]
        assert got["scheduler"] == want["scheduler"] and got["step"] == want["step"] == 4


def test_async_training_run_matches_sync_saves(one_rank, tmp_path):
    """checkpoint.async_mode = 'async' on a training run -> the same per-step metrics as sync saves, and every step-N folder present at the end with byte-identical model and optimizer shards"""
    _train_here(tmp_path, ["--checkpoint.async_mode=async"])  # in this process, as `one_rank`
    got, want = _steps(tmp_path), _steps(one_rank)
    for s in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert got[s][key] == want[s][key], (s, key)
    assert CheckpointManager(str(tmp_path / "checkpoint"), 0).complete_steps() == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        shards = [p for p in (one_rank / "checkpoint" / f"step-{s}").iterdir() if p.suffix == ".distcp"]
        assert shards
        for shard in shards:  # (.metadata differs: it records the folder it was written to)
            assert (tmp_path / "checkpoint" / f"step-{s}" / shard.name).read_bytes() == shard.read_bytes(), (s, shard)


# ---- in-process: a tiny model, no process group (DCP saves as a single process) ----


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)  # AdamW has state to save
    return model, optimizer


def _step(model, optimizer, n=1):
    for _ in range(n):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _save(manager, step, model, optimizer):
    return manager.save(step, {"model": model}, {"model": optimizer}, {"step": step})


def _snapshot(model, optimizer) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()},
    }


def _assert_restores(manager, step, want):
    model, optimizer = _tiny()
    restored = manager.load_latest({"model": model}, {"model": optimizer})
    assert restored is not None and restored[0] == step
    got = _snapshot(model, optimizer)
    for part in ("model", "optimizer"):
        assert got[part].keys() == want[part].keys()
        for key in want[part]:
            if part == "model":
                assert torch.equal(got[part][key], want[part][key]), key
            else:
                for name, value in want[part][key].items():
                    assert torch.equal(got[part][key][name], value), (key, name)


def test_async_save_holds_the_state_at_save_time(tmp_path):
    """Async save, training goes on while it writes -> step-N appears as soon as the write has finished, before any wait() (a crash later loses nothing); it holds the state at save time, bitwise, not the state training moved on to"""
    model, optimizer = _tiny()
    manager = CheckpointManager(str(tmp_path), keep_latest_k=0, async_mode="async")
    at_save = _snapshot(model, optimizer)
    _save(manager, 1, model, optimizer)
    _step(model, optimizer, 3)
    deadline = time.monotonic() + 60
    while manager.complete_steps() != [1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.complete_steps() == [1]
    manager.wait()
    _assert_restores(manager, 1, at_save)
    assert not torch.equal(model[0].weight, at_save["model"]["0.weight"])  # training did move on


def _disk_full(self, path, mode):
    """FileSystem.create_stream on a full disk: the first bytes land, then ENOSPC."""
    with open(path, mode) as f:
        f.write(b"\0" * 100)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("part", ["shards", "host_state"])
def test_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, async_mode, part):
    """Disk full while writing a checkpoint (model shards or host state; sync or async save) -> CheckpointSaveError naming the folder, 'no free space' and the fix; the partial folder is removed, no step-N appears, the previous checkpoint stays the latest and loads; the next save works"""
    folder = str(tmp_path / "checkpoint")
    manager = CheckpointManager(folder, keep_latest_k=0, async_mode=async_mode)
    model, optimizer = _tiny()
    _save(manager, 1, model, optimizer)
    manager.wait()
    at_step_1 = _snapshot(model, optimizer)
    _step(model, optimizer)
    if part == "shards":
        monkeypatch.setattr(FileSystem, "create_stream", contextlib.contextmanager(_disk_full))
    else:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, str) and os.path.basename(f).startswith("host_rank"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CheckpointSaveError) as failure:
        _save(manager, 2, model, optimizer)
        manager.wait()  # an async save's write error surfaces here
    monkeypatch.undo()
    message = str(failure.value)
    assert f"cannot write the step 2 checkpoint to '{folder}'" in message
    assert "no free space left on the device" in message and "free disk space" in message
    assert "step-1 is still the latest checkpoint" in message
    assert sorted(os.listdir(folder)) == ["step-1"]
    assert manager.complete_steps() == [1]
    _assert_restores(manager, 1, at_step_1)
    _save(manager, 3, model, optimizer)  # space freed: the next save works
    manager.wait()
    assert manager.complete_steps() == [1, 3]


def test_read_only_checkpoint_folder_fails_the_save_with_the_cause(tmp_path, monkeypatch):
    """Checkpoint folder read-only (permissions or a read-only mount) -> CheckpointSaveError naming the folder, 'permission denied or read-only' and the fix; no step-N appears, the previous checkpoint stays the latest"""
    folder = str(tmp_path / "checkpoint")
    manager = CheckpointManager(folder, keep_latest_k=0)
    model, optimizer = _tiny()
    _save(manager, 1, model, optimizer)
    os.chmod(folder, 0o555)
    if os.geteuid() == 0:
        # root ignores permission bits: refuse as a read-only mount would.
        real_makedirs = os.makedirs

        def makedirs(path, *args, **kwargs):
            if os.path.abspath(path).startswith(folder):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_makedirs(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", makedirs)
    try:
        with pytest.raises(CheckpointSaveError) as failure:
            _save(manager, 2, model, optimizer)
    finally:
        os.chmod(folder, 0o755)
    message = str(failure.value)
    assert f"cannot write the step 2 checkpoint to '{folder}'" in message
    assert "permission denied or read-only file system" in message and "writable" in message
    assert manager.complete_steps() == [1] and sorted(os.listdir(folder)) == ["step-1"]


def test_kill_9_during_async_save_keeps_the_previous_checkpoint_latest(tmp_path):
    """kill -9 while an async save is still writing -> no step-N for it (its files stay in .tmp-step-N, never loaded); the previous checkpoint is the latest and loads bitwise"""
    proc = run_cmd([sys.executable, __file__, "kill-during-async-save", str(tmp_path)], ENV, timeout_s=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    manager = CheckpointManager(str(tmp_path / "checkpoint"), 0)
    assert manager.complete_steps() == [1]
    assert ".tmp-step-2" in os.listdir(tmp_path / "checkpoint")
    _assert_restores(manager, 1, torch.load(tmp_path / "at_step_1.pt"))


def _kill_during_async_save(folder: str) -> None:
    manager = CheckpointManager(os.path.join(folder, "checkpoint"), 0, async_mode="async")
    model, optimizer = _tiny()
    _save(manager, 1, model, optimizer)
    manager.wait()
    torch.save(_snapshot(model, optimizer), os.path.join(folder, "at_step_1.pt"))
    _step(model, optimizer)
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def slow(self, path, mode):
        time.sleep(30)  # still writing when the kill comes
        with real(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = slow
    _save(manager, 2, model, optimizer)
    os.kill(os.getpid(), 9)


# ---- two gloo ranks: async saves while training's collectives run, one rank failing ----


@pytest.mark.multirank
def test_two_ranks_async_save_and_one_rank_failing_to_write(tmp_path):
    """2 FSDP ranks: async save while training's own collectives run; then one rank's disk full (host state, sync save; model shards, async save) -> no hang; the async checkpoint equals a sync one bitwise; every rank raises CheckpointSaveError, the failing one naming 'no free space'; no step-N for the failed saves, the next save succeeds"""
    run_torchrun(__file__, 2, ["two-ranks", str(tmp_path)])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(results):
        assert r["async_equals_sync"], rank
        assert r["complete_steps"] == [1, 4], rank
        assert r["leftovers"] == [], rank
        assert r["async_group_freed"], rank
    # Rank 1 could not write its host state: it names the cause, rank 0 names rank 1.
    assert "no free space left on the device" in results[1]["host_state_error"]
    assert "rank(s) [1] failed to write their part" in results[0]["host_state_error"]
    # Rank 1 could not write its shards: DCP tells every rank why.
    for r in results:
        assert "no free space left on the device" in r["shards_error"]
        assert "step-1 is still the latest checkpoint" in r["shards_error"]


def _two_ranks(folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from titanrl.components.model_builder import build_model, full_state_dict
    from titanrl.config.job_config import JobConfig
    from titanrl.distributed import ParallelDims, init_distributed
    from titanrl.models import get_model_args

    rank, world_size = init_distributed()
    dims = ParallelDims(1, world_size, 1, world_size=world_size)
    args = get_model_args("debug")
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))

    def build():
        model = build_model(args, dims, JobConfig(), torch.device("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train(model, optimizer, n):
        for _ in range(n):
            model(tokens).float().logsumexp(-1).mean().backward()  # FSDP collectives on the default group
            optimizer.step()
            optimizer.zero_grad()

    def save(manager, step, model, optimizer):
        return manager.save(step, {"model": model}, {"model": optimizer}, {"step": step})

    def full(model, optimizer):
        optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return full_state_dict(model), optim["state"]

    def loaded(manager, step):
        model, optimizer = build()
        manager.load(manager.step_dir(step), {"model": model}, {"model": optimizer})
        return full(model, optimizer)

    model, optimizer = build()
    train(model, optimizer, 1)
    sync = CheckpointManager(os.path.join(folder, "sync"), 0)
    manager = CheckpointManager(os.path.join(folder, "async"), 0, async_mode="async")
    save(sync, 1, model, optimizer)
    save(manager, 1, model, optimizer)
    train(model, optimizer, 3)  # while step 1 is written in the background
    manager.wait()
    (model_a, optim_a), (model_s, optim_s) = loaded(manager, 1), loaded(sync, 1)
    same = all(torch.equal(model_a[k], model_s[k]) for k in model_s) and all(
        torch.equal(optim_a[p][k], optim_s[p][k]) for p in optim_s for k in optim_s[p]
    )

    errors = {}
    real_save, real_stream = torch.save, FileSystem.create_stream
    if rank == 1:

        def full_disk_save(obj, f, *a, **k):
            if isinstance(f, str) and os.path.basename(f).startswith("host_rank"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)
            return real_save(obj, f, *a, **k)

        torch.save = full_disk_save
    try:
        save(manager, 2, model, optimizer)
    except CheckpointSaveError as e:
        errors["host_state_error"] = str(e)
    torch.save = real_save
    if rank == 1:
        FileSystem.create_stream = contextlib.contextmanager(_disk_full)
    try:
        save(manager, 3, model, optimizer)
        manager.wait()
    except CheckpointSaveError as e:
        errors["shards_error"] = str(e)
    FileSystem.create_stream = real_stream
    save(manager, 4, model, optimizer)
    manager.wait()
    # After the failed saves, close() frees the writer's group now (not at interpreter exit, where
    # tearing gloo down aborted a rank once in a while).
    group = weakref.ref(manager.writer.group)
    manager.close()
    result = {
        "async_equals_sync": same,
        "complete_steps": manager.complete_steps(),
        "leftovers": [d for d in os.listdir(manager.folder) if d.startswith(".tmp")],
        "async_group_freed": group() is None,
        **errors,
    }
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "two-ranks":
        _two_ranks(sys.argv[2])
    elif sys.argv[1] == "kill-during-async-save":
        _kill_during_async_save(sys.argv[2])

"""Checkpoint integrity in process: checksum manifests, bit flips, host state that would run code,
checkpoints without a manifest, and a real tmpfs too small for a checkpoint.

A tiny model saved by `CheckpointManager` as a single process (DCP without a process group); the
end-to-end runs (`titanrl.train` resuming over a flipped checkpoint, on 1 and 2 ranks) are in
tests/test_checkpoint.py. Each docstring '<fault> -> <observed behaviour>' is a row of the table
in docs/reliability.md.
"""

import json
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
from helpers.checkpoint_faults import flip, kind_file, plant_code
from torch import nn

from titanrl.components.checkpoint import CheckpointCorrupt, CheckpointManager, CheckpointSaveError, verify_checkpoint
from titanrl.components.checkpoint_integrity import MANIFEST, file_checksum


def _model(width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer)  # AdamW has state to save
    return model, optimizer


def _step(model, optimizer):
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save(manager, step, model, optimizer, host_bytes: int = 0):
    host = {"step": step, "rng": torch.get_rng_state(), "payload": torch.zeros(host_bytes, dtype=torch.uint8)}
    manager.save(step, {"model": model}, {"model": optimizer}, host)
    manager.wait()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _two_checkpoints(folder, async_mode="disabled"):
    """step-1 and step-2 of a training tiny model; returns the manager and step 1's parameters."""
    manager = CheckpointManager(str(folder), keep_latest_k=0, async_mode=async_mode)
    model, optimizer = _model()
    _save(manager, 1, model, optimizer)
    at_step_1 = _params(model)
    _step(model, optimizer)
    _save(manager, 2, model, optimizer)
    return manager, at_step_1


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_manifest_lists_every_file_of_the_checkpoint(tmp_path, async_mode):
    """Checkpoint saved (sync or async) -> checksums.json lists every file of step-N (DCP shards, .metadata, host state) with size and CRC-32, and verifies"""
    manager, _ = _two_checkpoints(tmp_path, async_mode)
    for step in (1, 2):
        step_dir = manager.step_dir(step)
        files = json.load(open(os.path.join(step_dir, MANIFEST)))["files"]
        assert sorted(files) == sorted(set(os.listdir(step_dir)) - {MANIFEST})
        assert {".metadata", "host_rank0.pt"} <= set(files) and any(n.endswith(".distcp") for n in files)
        for name, want in files.items():
            assert file_checksum(os.path.join(step_dir, name)) == want
        verify_checkpoint(step_dir)


@pytest.mark.parametrize("kind", ["shard", "metadata", "host"])
def test_bit_flip_in_latest_checkpoint_is_skipped_with_one_line(tmp_path, kind):
    """16 bytes flipped in one file of the latest checkpoint (a .distcp shard, .metadata or host state; size unchanged) -> verify_checkpoint raises CheckpointCorrupt naming the file; load_latest prints one line naming it, writes the traceback to checkpoint_errors.log and restores the previous checkpoint bitwise"""
    manager, at_step_1 = _two_checkpoints(tmp_path / "checkpoint")
    bad = kind_file(manager.step_dir(2), kind)
    flip(bad)
    with pytest.raises(CheckpointCorrupt) as failure:
        verify_checkpoint(manager.step_dir(2))
    message = str(failure.value)
    assert len(message.splitlines()) == 1
    assert f"step-2 is corrupt: {os.path.basename(bad)} has CRC-32" in message
    lines = []
    model, optimizer = _model()
    restored = manager.load_latest({"model": model}, {"model": optimizer}, log=lines.append)
    assert restored is not None and restored[0] == 1 and restored[1]["step"] == 1
    assert all(torch.equal(v, at_step_1[k]) for k, v in model.state_dict().items())
    assert len(lines) == 1 and len(lines[0].splitlines()) == 1
    assert os.path.basename(bad) in lines[0] and "checkpoint_errors.log" in lines[0]
    log = open(tmp_path / "checkpoint_errors.log").read()
    assert "Traceback" in log and "step-2" in log


def test_every_checkpoint_corrupt_stops_instead_of_starting_afresh(tmp_path):
    """Bit flip in the only checkpoint -> load_latest raises CheckpointCorrupt (a user error: one line, exit 2), never a silent fresh start"""
    manager = CheckpointManager(str(tmp_path / "checkpoint"), keep_latest_k=0)
    model, optimizer = _model()
    _save(manager, 1, model, optimizer)
    flip(kind_file(manager.step_dir(1), "shard"))
    with pytest.raises(CheckpointCorrupt) as failure:
        manager.load_latest({"model": model}, {"model": optimizer}, log=lambda _: None)
    message = str(failure.value)
    assert len(message.splitlines()) == 1
    assert "no checkpoint in" in message and "step-1 is corrupt" in message and "checkpoint.load_path" in message


def test_host_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    """Host-state file replaced by a pickle that calls os.system (manifest rewritten to match) -> refused with one line naming the file, nothing runs (no marker file); load_latest falls back to the previous checkpoint"""
    manager, at_step_1 = _two_checkpoints(tmp_path / "checkpoint")
    marker = tmp_path / "ran"
    plant_code(manager.step_dir(2), str(marker))
    with pytest.raises(CheckpointCorrupt) as failure:
        verify_checkpoint(manager.step_dir(2))
    message = str(failure.value)
    assert len(message.splitlines()) == 1 and "is refused: host_rank0.pt is not plain data" in message
    lines = []
    model, optimizer = _model()
    assert manager.load_latest({"model": model}, {"model": optimizer}, log=lines.append)[0] == 1
    assert len(lines) == 1 and "host_rank0.pt is not plain data" in lines[0]
    assert not marker.exists()
    # The planted file does run code when loaded as before (weights_only=False): the test is real.
    torch.load(os.path.join(manager.step_dir(2), "host_rank0.pt"), weights_only=False)
    assert marker.exists()


def test_checkpoint_without_manifest_loads_with_a_notice(tmp_path):
    """Checkpoint written before checksums (no checksums.json) -> loads, with one line saying it was not checked"""
    manager, _ = _two_checkpoints(tmp_path / "checkpoint")
    os.remove(os.path.join(manager.step_dir(2), MANIFEST))
    verify_checkpoint(manager.step_dir(2))  # nothing to check it against: passes
    lines = []
    model, optimizer = _model()
    assert manager.load_latest({"model": model}, {"model": optimizer}, log=lines.append)[0] == 2
    assert len(lines) == 1 and "has no checksums.json" in lines[0] and "unchecked" in lines[0]


def test_manifest_that_does_not_parse_rejects_the_checkpoint(tmp_path):
    """checksums.json itself damaged -> the checkpoint is rejected with one line naming it; the previous one loads"""
    manager, _ = _two_checkpoints(tmp_path / "checkpoint")
    flip(os.path.join(manager.step_dir(2), MANIFEST), 0.2, 4)
    with pytest.raises(CheckpointCorrupt, match="step-2 is corrupt: checksums.json cannot be read"):
        verify_checkpoint(manager.step_dir(2))
    model, optimizer = _model()
    assert manager.load_latest({"model": model}, {"model": optimizer}, log=lambda _: None)[0] == 1


@pytest.fixture
def small_tmpfs():
    """A real tmpfs of 4 MiB: one checkpoint of the model below (2.5 MiB of shards, 1 MiB of host
    state) fits, two do not."""
    folder = tempfile.mkdtemp()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder], capture_output=True)
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        # Lazy: the failed write's file may still be open from the error's traceback frames.
        subprocess.run(["umount", "--lazy", folder], check=True)
        os.rmdir(folder)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_tmpfs_too_small_says_no_space_left(small_tmpfs, async_mode):
    """Checkpoint folder on a real tmpfs too small for a second checkpoint (sync or async save; the host state is the first file that no longer fits, and torch's zip writer reports it as 'RuntimeError: [enforce fail at inline_container.cc] unexpected pos', no errno) -> CheckpointSaveError saying 'no space left on device' (from statvfs) and the folder; the previous checkpoint stays the latest and loads"""
    folder = os.path.join(small_tmpfs, "checkpoint")
    manager = CheckpointManager(folder, keep_latest_k=0, async_mode=async_mode)
    model, optimizer = _model(width=16384)
    _save(manager, 1, model, optimizer, host_bytes=2**20)
    at_step_1 = _params(model)
    _step(model, optimizer)
    with pytest.raises(CheckpointSaveError) as failure:
        _save(manager, 2, model, optimizer, host_bytes=2**20)
    assert failure.value.__cause__ is None  # the message says it all
    message = str(failure.value)
    assert "the writer failed with RuntimeError: [enforce fail at inline_container.cc" in message
    assert "no space left on device" in message and f"'{folder}'" in message
    assert "step-1 is still the latest checkpoint" in message and len(message.splitlines()) == 1
    assert manager.complete_steps() == [1] and sorted(os.listdir(folder)) == ["step-1"]
    fresh, fresh_optimizer = _model(width=16384)
    assert manager.load_latest({"model": fresh}, {"model": fresh_optimizer})[0] == 1
    assert all(torch.equal(v, at_step_1[k]) for k, v in fresh.state_dict().items())
    shutil.rmtree(folder)


def test_optimizer_saved_before_its_first_step_resumes_fresh(tmp_path):
    """A checkpoint of an optimizer that never stepped though its parameters have gradients (PPO's policy during the critic warm-up) -> loads: that optimizer stays without state, as it was, and the next step equals the uninterrupted run's"""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()  # gradients, no step: DCP leaves the state empty
    manager = CheckpointManager(str(tmp_path), keep_latest_k=0)
    _save(manager, 1, model, optimizer)
    resumed = nn.Linear(8, 4)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    manager.load(manager.step_dir(1), {"model": resumed}, {"model": resumed_optimizer})
    assert not resumed_optimizer.state
    x = torch.randn(4, 8)
    for m, opt in ((model, optimizer), (resumed, resumed_optimizer)):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in model.state_dict().items())

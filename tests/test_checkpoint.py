"""Checkpoints: exact resume, resharding 2 -> 1 ranks, kill -9 mid-step and mid-save, corruption."""

import os
import shutil
import sys

import pytest
from helpers.checkpoint_faults import flip, kind_file, plant_code
from helpers.checkpoint_runs import BASE, assert_same_weights, ok, run, same, steps
from helpers.launch import REPO_ROOT, run_cmd
from helpers.tiny import DEBUG_CONFIG


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full")
    ok(run(folder, 4))
    return folder


def test_exact_resume_after_stop(tmp_path, uninterrupted):
    """Run stopped after step 2, same command re-run -> resumes from step-2; every step's metrics and the final weights are bit-identical to an uninterrupted run"""
    out = ok(run(tmp_path, 2))
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]
    out = ok(run(tmp_path, 4))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    same(steps(tmp_path), steps(uninterrupted), [1, 2, 3, 4])  # bit-exact on CPU
    assert_same_weights(tmp_path, uninterrupted)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]  # keep_latest_k=2


@pytest.mark.multirank
def test_saved_on_two_ranks_resumes_on_one_with_identical_parameters(tmp_path, uninterrupted_two_ranks):
    """Checkpoint saved on 2 ranks (FSDP2), resumed on 1 -> identical model parameters"""
    two, one = uninterrupted_two_ranks, tmp_path / "one"
    shutil.copytree(two / "checkpoint", one / "checkpoint")  # a copy: the 2-rank run is shared
    out = ok(run(one, 4))  # nothing left to train: loads step 4 and exports it
    assert "resumed from" in out.stdout and "step-4" in out.stdout
    assert_same_weights(one, two)  # == the 2-rank run's own end-of-run export


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ["step:3:1", "checkpoint_save:4:1"])
def test_kill_9_a_rank_then_rerun_finishes_like_uninterrupted(tmp_path, uninterrupted_two_ranks, fault):
    """kill -9 of rank 1 mid-step (after step 3's update) or mid-save (step-4 shards written, not renamed), then the same command again -> resumes from step-2; metrics and final weights bit-identical to an uninterrupted 2-rank run; no temporary folder left"""
    crashed = run(tmp_path, 4, nproc=2, fault=fault)
    assert crashed.returncode != 0
    assert "step-4" not in os.listdir(tmp_path / "checkpoint")
    out = ok(run(tmp_path, 4, nproc=2))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    same(steps(tmp_path), steps(uninterrupted_two_ranks), [1, 2, 3, 4])
    assert_same_weights(tmp_path, uninterrupted_two_ranks)
    assert not [d for d in os.listdir(tmp_path / "checkpoint") if d.startswith(".tmp")]


def _copy_run(src, dst):
    """A copy of a finished run's dump folder (checkpoints step-2 and step-4), without its export."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "hf")
    return dst


def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, uninterrupted):
    """Latest checkpoint truncated -> reported in one line as corrupt (its size differs from the manifest), the previous one is used, the run ends bit-identical"""
    folder = _copy_run(uninterrupted, tmp_path / "run")  # the same 4-step run's checkpoints
    step4 = folder / "checkpoint" / "step-4"
    shard = next(p for p in step4.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncate
    out = ok(run(folder, 4))
    notices = [line for line in out.stdout.splitlines() if "step-4" in line]
    assert len(notices) == 1 and f"step-4 is corrupt: {shard.name} has 100 bytes" in notices[0], out.stdout
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    assert_same_weights(folder, uninterrupted)


@pytest.mark.parametrize("kind", ["shard", "metadata", "host"])
def test_bit_flip_in_latest_checkpoint_resumes_from_previous(tmp_path, uninterrupted, kind):
    """16 bytes flipped in a file of the latest checkpoint (a .distcp shard, .metadata or host state; size unchanged), same command again -> one line names the file and skips it (traceback in <dump>/checkpoint_errors.log); resumes from step-2 and ends with the same final weights as an uninterrupted run"""
    folder = _copy_run(uninterrupted, tmp_path / "run")
    bad = kind_file(folder / "checkpoint" / "step-4", kind)
    flip(bad)
    out = ok(run(folder, 4))
    notices = [line for line in out.stdout.splitlines() if "step-4" in line]
    assert len(notices) == 1, out.stdout
    assert f"step-4 is corrupt: {os.path.basename(bad)} has CRC-32" in notices[0]
    assert "checkpoint_errors.log" in notices[0] and "Traceback" in (folder / "checkpoint_errors.log").read_text()
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    assert_same_weights(folder, uninterrupted)


def test_bit_flip_in_the_only_checkpoint_stops_with_one_line(tmp_path, uninterrupted):
    """Bit flip in the only checkpoint, same command again -> exit 2 with exactly one stderr line naming the file and the fix; no fresh run starts"""
    folder = _copy_run(uninterrupted, tmp_path / "run")
    shutil.rmtree(folder / "checkpoint" / "step-2")
    flip(kind_file(folder / "checkpoint" / "step-4", "shard"))
    proc = run(folder, 6)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("titanrl: error: no checkpoint in") and "step-4 is corrupt: __0_0.distcp" in lines[0]
    assert "checkpoint.load_path" in lines[0]
    assert not (folder / "hf").exists() and sorted(os.listdir(folder / "checkpoint")) == ["step-4"]


def test_preflight_picks_the_latest_checkpoint_that_passes_its_checksums(tmp_path, uninterrupted):
    """Bytes flipped in the latest checkpoint, then in both -> `titanrl run`'s pre-flight picks step-2 (the one the ranks will load), then stops with one line naming each corrupt file"""
    from titanrl.components.checkpoint_integrity import CheckpointCorrupt
    from titanrl.components.launch import checkpoint_to_load
    from titanrl.config import load_config

    folder = _copy_run(uninterrupted, tmp_path / "run")
    config = load_config([*BASE, f"--job.dump_folder={folder}"])
    assert checkpoint_to_load(config) == str(folder / "checkpoint" / "step-4")
    flip(kind_file(folder / "checkpoint" / "step-4", "shard"))
    assert checkpoint_to_load(config) == str(folder / "checkpoint" / "step-2")
    flip(kind_file(folder / "checkpoint" / "step-2", "host"))
    with pytest.raises(CheckpointCorrupt) as e:
        checkpoint_to_load(config)
    message = str(e.value)
    assert "\n" not in message and "step-4 is corrupt" in message and "step-2 is corrupt: host_rank0.pt" in message


def test_load_path_with_host_state_that_would_run_code_is_refused(tmp_path, uninterrupted):
    """checkpoint.load_path to a checkpoint whose host state is a pickle calling os.system (manifest rewritten to match) -> exit 2 with one stderr line naming the file; the code never runs"""
    src = _copy_run(uninterrupted, tmp_path / "src")
    marker = tmp_path / "ran"
    plant_code(src / "checkpoint" / "step-4", str(marker))
    proc = run(tmp_path / "run", 4, extra=[f"--checkpoint.load_path={src / 'checkpoint' / 'step-4'}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is refused: host_rank0.pt is not plain data" in lines[0], proc.stderr
    assert not marker.exists()


@pytest.mark.multirank
def test_bit_flip_on_two_ranks_resumes_from_previous(tmp_path, uninterrupted_two_ranks):
    """2 ranks: bytes flipped in rank 1's shard of the latest checkpoint -> both ranks skip it (one line), resume from step-2 and end with the same final weights as an uninterrupted 2-rank run"""
    folder = _copy_run(uninterrupted_two_ranks, tmp_path / "run")
    flip(folder / "checkpoint" / "step-4" / "__1_0.distcp")
    out = ok(run(folder, 4, nproc=2))
    notices = [line for line in out.stdout.splitlines() if "step-4 is corrupt" in line]
    assert len(notices) == 1 and "__1_0.distcp has CRC-32" in notices[0], out.stdout
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    assert_same_weights(folder, uninterrupted_two_ranks)


def test_convert_checkpoint_to_hf_loads_in_transformers(tmp_path, uninterrupted):
    """Checkpoint converted with scripts/convert_to_hf.py -> loads in transformers; logits within 1e-4 of titanrl's"""
    transformers = pytest.importorskip("transformers")
    import torch
    import torch.distributed.checkpoint as dcp

    from titanrl.models import Transformer, get_model_args

    step4 = uninterrupted / "checkpoint" / "step-4"
    out = tmp_path / "hf"
    cmd = [
        sys.executable,
        os.path.join(REPO_ROOT, "scripts", "convert_to_hf.py"),
        "--checkpoint",
        str(step4),
        "--out",
        str(out),
        f"--job.config_file={DEBUG_CONFIG}",
    ]
    proc = run_cmd(cmd, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    ours = Transformer(get_model_args("debug"))
    ours.init_weights()
    state = {"model": ours.state_dict()}
    dcp.load(state, checkpoint_id=str(step4), no_dist=True)
    ours.load_state_dict(state["model"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 259, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(input_ids=tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff < 1e-4
    assert_same_weights(tmp_path, uninterrupted)  # == the run's own end-of-run export


def test_load_path_branches_a_run_from_a_given_checkpoint(tmp_path, uninterrupted):
    """checkpoint.load_path = an older step folder, new dump folder -> continues from that step; same result as never stopping"""
    out = ok(run(tmp_path, 4, extra=[f"--checkpoint.load_path={uninterrupted / 'checkpoint' / 'step-2'}"]))
    assert "resumed from" in out.stdout
    same(steps(tmp_path), steps(uninterrupted), [3, 4])
    assert_same_weights(tmp_path, uninterrupted)
    bad = run(tmp_path / "x", 4, extra=[f"--checkpoint.load_path={tmp_path}"])
    assert bad.returncode == 2 and "is not a complete titanrl step-N checkpoint" in bad.stderr


PARTIAL = [
    "--rollout.partial=true",
    "--algorithm.off_policy_correction=tis",
    "--generator.max_new_tokens=12",
    "--rollout.max_step_tokens=40",
]
PARTIAL_COMPARED = ["stale_token_frac", "version_lag_mean", "in_flight_groups", "paused_samples", "trained_groups"]


def test_kill_9_with_paused_samples_in_flight_resumes_exactly(tmp_path):
    """Partial rollouts: kill -9 after step 3 while the step-2 checkpoint holds paused samples, same command again -> resumes from step-2 with those samples in flight; every step's metrics (staleness included) and the final weights bit-identical to an uninterrupted run"""
    import torch

    full, crashed = tmp_path / "full", tmp_path / "crashed"
    ok(run(full, 4, extra=PARTIAL))
    assert run(crashed, 4, fault="step:3:0", extra=PARTIAL).returncode != 0
    host = torch.load(crashed / "checkpoint" / "step-2" / "host_rank0.pt", weights_only=True)  # plain data
    samples = [s for g in host["recipe"]["in_flight"] for s in g["samples"]]
    paused = [s for s in samples if s["finish_reason"] is None and s["token_ids"]]
    assert paused, "the checkpoint holds no paused sample: the test would not exercise resuming them"
    out = ok(run(crashed, 4, extra=PARTIAL))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    a, b = steps(crashed), steps(full)
    same(a, b, [1, 2, 3, 4])
    for s in [1, 2, 3, 4]:
        assert {k: a[s][k] for k in PARTIAL_COMPARED} == {k: b[s][k] for k in PARTIAL_COMPARED}, s
    assert max(b[s]["stale_token_frac"] for s in [2, 3, 4]) > 0  # samples really continued across steps
    assert_same_weights(crashed, full)

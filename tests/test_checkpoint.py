"""Checkpoints: exact resume, resharding 2 -> 1 ranks, kill -9 mid-step and mid-save, corruption."""

import json
import os
import sys

import pytest
from helpers.launch import REPO_ROOT, run_cmd, train_cmd
from safetensors.torch import load_file

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
BASE = [
    f"--job.config_file={CONFIG}",
    "--sft_warmup.steps=3",
    "--sft_warmup.batch_size=8",
    "--training.batch_size=4",
    "--algorithm.group_size=4",
    "--generator.max_new_tokens=6",
    "--data.num_eval_samples=8",
    "--reward.num_workers=1",
    "--metrics.eval_freq=0",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=2",
    "--checkpoint.export_hf=true",
    "--optimizer.lr=1e-3",
]
COMPARED = ["reward_mean", "accuracy", "response_len", "entropy", "grad_norm", "lr"]


def _run(folder, steps, nproc=1, fault=None, extra=()):
    args = [*BASE, f"--training.steps={steps}", f"--job.dump_folder={folder}", *extra]
    cmd = train_cmd([*args, "--parallelism.dp_shard=2"] if nproc > 1 else args, nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TITANRL_FAULT", None)
    if fault:
        env["TITANRL_FAULT"] = fault
    return run_cmd(cmd, env)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _steps(folder) -> dict[int, dict]:
    """Last record of each RL step (a step redone after a crash is logged again)."""
    out = {}
    for line in open(os.path.join(folder, "metrics.jsonl")):
        r = json.loads(line)
        if r.get("phase") == "rl" and "reward_mean" in r:
            out[r["step"]] = r
    return out


def _same(a: dict[int, dict], b: dict[int, dict], steps):
    for s in steps:
        assert {k: a[s][k] for k in COMPARED} == {k: b[s][k] for k in COMPARED}, s


def _weights(folder):
    hf = os.path.join(folder, "hf", "model.safetensors")
    return load_file(hf)


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] == wb[k]).all(), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("full")
    _ok(_run(folder, 4))
    return folder


def test_exact_resume_after_stop(tmp_path, uninterrupted):
    """Run stopped after step 2, same command re-run -> resumes from step-2; every step's metrics and the final weights are bit-identical to an uninterrupted run"""
    out = _ok(_run(tmp_path, 2))
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]
    out = _ok(_run(tmp_path, 4))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    _same(_steps(tmp_path), _steps(uninterrupted), [1, 2, 3, 4])  # bit-exact on CPU
    _assert_same_weights(tmp_path, uninterrupted)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]  # keep_latest_k=2


@pytest.mark.multirank
def test_saved_on_two_ranks_resumes_on_one_with_identical_parameters(tmp_path):
    """Checkpoint saved on 2 ranks (FSDP2), resumed on 1 -> identical model parameters"""
    two, one = tmp_path / "two", tmp_path / "one"
    _ok(_run(two, 2, nproc=2))
    os.makedirs(one)
    os.symlink(two / "checkpoint", one / "checkpoint")
    out = _ok(_run(one, 2))  # nothing left to train: loads step 2 and exports it
    assert "resumed from" in out.stdout
    _assert_same_weights(one, two)


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ["step:3:1", "checkpoint_save:4:1"])
def test_kill_9_a_rank_then_rerun_finishes_like_uninterrupted(tmp_path, uninterrupted_two_ranks, fault):
    """kill -9 of rank 1 mid-step (after step 3's update) or mid-save (step-4 shards written, not renamed), then the same command again -> resumes from step-2; metrics and final weights bit-identical to an uninterrupted 2-rank run; no temporary folder left"""
    crashed = _run(tmp_path, 4, nproc=2, fault=fault)
    assert crashed.returncode != 0
    assert "step-4" not in os.listdir(tmp_path / "checkpoint")
    out = _ok(_run(tmp_path, 4, nproc=2))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    _same(_steps(tmp_path), _steps(uninterrupted_two_ranks), [1, 2, 3, 4])
    _assert_same_weights(tmp_path, uninterrupted_two_ranks)
    assert not [d for d in os.listdir(tmp_path / "checkpoint") if d.startswith(".tmp")]


def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, uninterrupted):
    """Latest checkpoint truncated -> reported as 'cannot be loaded', the previous one is used, the run ends bit-identical"""
    _ok(_run(tmp_path, 4))
    step4 = tmp_path / "checkpoint" / "step-4"
    shard = next(p for p in step4.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncate
    out = _ok(_run(tmp_path, 4))
    assert "step-4 cannot be loaded" in out.stdout
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    _assert_same_weights(tmp_path, uninterrupted)


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
        f"--job.config_file={CONFIG}",
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
    _assert_same_weights(tmp_path, uninterrupted)  # == the run's own end-of-run export


def test_load_path_branches_a_run_from_a_given_checkpoint(tmp_path, uninterrupted):
    """checkpoint.load_path = an older step folder, new dump folder -> continues from that step; same result as never stopping"""
    out = _ok(_run(tmp_path, 4, extra=[f"--checkpoint.load_path={uninterrupted / 'checkpoint' / 'step-2'}"]))
    assert "resumed from" in out.stdout
    _same(_steps(tmp_path), _steps(uninterrupted), [3, 4])
    _assert_same_weights(tmp_path, uninterrupted)
    bad = _run(tmp_path / "x", 4, extra=[f"--checkpoint.load_path={tmp_path}"])
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
    _ok(_run(full, 4, extra=PARTIAL))
    assert _run(crashed, 4, fault="step:3:0", extra=PARTIAL).returncode != 0
    host = torch.load(crashed / "checkpoint" / "step-2" / "host_rank0.pt", weights_only=False)
    paused = [s for g in host["recipe"]["in_flight"] for s in g.samples if s.finish_reason is None and s.token_ids]
    assert paused, "the checkpoint holds no paused sample: the test would not exercise resuming them"
    out = _ok(_run(crashed, 4, extra=PARTIAL))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    a, b = _steps(crashed), _steps(full)
    _same(a, b, [1, 2, 3, 4])
    for s in [1, 2, 3, 4]:
        assert {k: a[s][k] for k in PARTIAL_COMPARED} == {k: b[s][k] for k in PARTIAL_COMPARED}, s
    assert max(b[s]["stale_token_frac"] for s in [2, 3, 4]) > 0  # samples really continued across steps
    _assert_same_weights(crashed, full)

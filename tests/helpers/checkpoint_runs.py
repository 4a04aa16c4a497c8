"""The short RL runs with checkpoints that the crash, restart and corruption tests compare:
one command line (`BASE`), how to run it, and what "the same run" means (metrics, weights)."""

import json
import os

from safetensors.torch import load_file

from helpers.launch import run_cmd, train_cmd
from helpers.tiny import smoke_run_args

# Four RL steps after 3 SFT steps, a checkpoint every 2 steps (the last two kept), an HF export.
BASE = smoke_run_args(
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=2",
    "--checkpoint.export_hf=true",
    "--optimizer.lr=1e-3",
    steps=None,
    sft_steps=3,
)
COMPARED = ["reward_mean", "accuracy", "response_len", "entropy", "grad_norm", "lr"]


def args(folder, steps, nproc=1, extra=()) -> list[str]:
    """The job's arguments: `BASE` for `steps` RL steps into `folder`, FSDP2 over `nproc` ranks."""
    argv = [*BASE, f"--training.steps={steps}", f"--job.dump_folder={folder}", *extra]
    return [*argv, "--parallelism.dp_shard=2"] if nproc > 1 else argv


def run(folder, steps, nproc=1, fault=None, extra=()):
    """`BASE` for `steps` RL steps into `folder` on `nproc` ranks (FSDP2 over them), with the
    TITANRL_FAULT injection `fault` (helpers/checkpoint_faults.py's kinds) when given."""
    cmd = train_cmd(args(folder, steps, nproc, extra), nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TITANRL_FAULT", None)
    if fault:
        env["TITANRL_FAULT"] = fault
    return run_cmd(cmd, env)


def ok(proc):
    """`proc` after asserting it exited 0 (its output's tails in the message otherwise)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def steps(folder) -> dict[int, dict]:
    """Last record of each RL step (a step redone after a crash is logged again)."""
    out = {}
    for line in open(os.path.join(folder, "metrics.jsonl")):
        r = json.loads(line)
        if r.get("phase") == "rl" and "reward_mean" in r:
            out[r["step"]] = r
    return out


def same(a: dict[int, dict], b: dict[int, dict], step_numbers):
    """The `COMPARED` metrics of each of `step_numbers` are bit-identical in `a` and `b`."""
    for s in step_numbers:
        assert {k: a[s][k] for k in COMPARED} == {k: b[s][k] for k in COMPARED}, s


def assert_same_weights(a, b):
    """The HF exports of run folders `a` and `b` hold bit-identical tensors."""
    wa, wb = (load_file(os.path.join(f, "hf", "model.safetensors")) for f in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] == wb[k]).all(), k

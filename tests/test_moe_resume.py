"""A whole `titanrl run` of the MoE recipe with expert parallelism (2 ranks, dp_shard = ep = 2:
the trainer's experts and the generator's sharded over both ranks) trains, checkpoints and
resumes exactly, and its checkpoint continues on one rank (ep = 1).

One module-scoped set of runs (3 launches): 4 RL steps on 2 ranks with checkpoints at steps 2 and
4; the same command in a folder holding only that run's step-2 checkpoint (a run stopped after
step 2), which resumes and must end with bitwise equal weights and step metrics; and one rank
continuing that step-2 checkpoint with `--checkpoint.load_path`.
"""

import json
import math
import os
import shutil

import pytest
from helpers.launch import REPO_ROOT, run_cmd, train_cmd, train_here
from helpers.tiny import MOE_DEBUG_CONFIG, smoke_run_args
from safetensors.torch import load_file

BASE = smoke_run_args(
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=0",
    "--checkpoint.export_hf=true",
    "--optimizer.lr=1e-3",
    config=MOE_DEBUG_CONFIG,
    steps=4,
    sft_steps=2,
    max_new_tokens=None,
)
EP2 = ["--parallelism.dp_shard=2", "--parallelism.ep=2"]
COMPARED = ["reward_mean", "response_len", "entropy", "grad_norm", "lr", "moe_aux_loss", "moe_route_disagree"]
pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _run(folder, nproc, extra=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    proc = run_cmd(train_cmd([*BASE, f"--job.dump_folder={folder}", *extra], nproc), env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _steps(folder) -> dict[int, dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r for r in rows if r.get("phase") == "rl" and "reward_mean" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    full, resumed, one = (tmp_path_factory.mktemp(name) for name in ("full", "resumed", "one"))
    out = {"full": _run(full, 2, EP2)}
    shutil.copytree(full / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    out["resumed"] = _run(resumed, 2, EP2)
    # One rank in this process (no interpreter start-up), on one thread as the ranks above.
    out["one"] = train_here(
        [*BASE, f"--job.dump_folder={one}", f"--checkpoint.load_path={full / 'checkpoint' / 'step-2'}"]
    )
    return {name: (folder, out[name]) for name, folder in (("full", full), ("resumed", resumed), ("one", one))}


def test_ep2_run_trains_and_checkpoints(runs):
    folder, stdout = runs["full"]
    assert "ep=2" in stdout
    assert sorted(os.listdir(folder / "checkpoint")) == ["step-2", "step-4"]
    steps = _steps(folder)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(math.isfinite(m["grad_norm"]) and m["moe_route_disagree"] == 0.0 for m in steps.values())


def test_ep2_run_resumed_at_step_2_equals_uninterrupted(runs):
    """4 steps == 2 steps + resume to 4, on 2 ranks with ep = 2: weights bitwise, metrics exact."""
    (full, _), (resumed, stdout) = runs["full"], runs["resumed"]
    assert "resumed from" in stdout and "step-2" in stdout
    got, want = _steps(resumed), _steps(full)
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert {k: got[s][k] for k in COMPARED} == {k: want[s][k] for k in COMPARED}, s
    a, b = load_file(full / "hf" / "model.safetensors"), load_file(resumed / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and any(".experts." in k or "experts" in k for k in a)
    for k in a:
        assert (a[k] == b[k]).all(), k


def test_ep2_checkpoint_continues_on_one_rank(runs):
    """Saved with ep = 2 (experts sharded over 2 ranks), resumed with ep = 1 on 1 rank: it loads
    and trains steps 3 and 4. Its first rollout samples the same tokens as the 2-rank run's (same
    weights, same per-sample seeds; deterministic on a CPU): a wrongly resharded expert would not.
    Losses are not compared: the load-balancing loss is a per-forward statistic, and 2 ranks
    forward half the batch each."""
    (_, stdout), (full, _) = runs["one"], runs["full"]
    assert "resumed from" in stdout and "step-2" in stdout and "ep=1" in stdout
    got, want = _steps(runs["one"][0]), _steps(full)
    assert sorted(got) == [3, 4] and all(math.isfinite(m["grad_norm"]) for m in got.values())
    assert got[3]["response_len"] == want[3]["response_len"] and got[3]["reward_mean"] == want[3]["reward_mean"]

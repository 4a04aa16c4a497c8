"""Context parallelism: the load-balanced sequence split, the all-gather attention backend against
plain causal SDPA (float64, gathers done in one process), and cp = 2, cp = 2 x dp_shard = 2 and
cp = 2 x tp = 2 under torchrun equal to one rank for GRPO updates (packed, token-mean and
sequence-mean) and SFT steps; a real job's rollouts split over cp = 2 ranks equal to one rank's;
a cp = 2 checkpoint resumed with cp = 1; the GPU script's dry run.
"""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import background
from helpers.launch import REPO_ROOT, run_cmd, train_cmd

from titanrl.config.job_config import JobConfig
from titanrl.data.packing import pack_layout
from titanrl.distributed import ParallelDims, context_parallel
from titanrl.distributed.context_parallel import CPAttention, shard_plan, validate_cp
from titanrl.models.attention import DocumentSDPA

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
import cp_worker  # noqa: E402

WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "cp_worker.py")
LAUNCHES = {2: ["cp2", "cp2_ac"], 4: ["dp2_cp2", "cp2_tp2"]}
ATOL = {"float32": 1e-5, "float64": 1e-10}


@pytest.mark.parametrize("S,cp", [(16, 2), (13, 2), (7, 4), (40, 4), (1, 2)])
def test_shards_are_head_and_tail_chunks_and_round_trip(S, cp):
    x_RS = torch.arange(3 * S).view(3, S)
    plans = [shard_plan(S, cp, r) for r in range(cp)]
    chunk = plans[0].S_pad // (2 * cp)
    gathered_RP = torch.cat([p.shard(x_RS, fill=-1) for p in plans], dim=1)
    back_RS = torch.empty_like(gathered_RP)
    back_RS[:, plans[0].order_P] = gathered_RP
    assert torch.equal(back_RS[:, :S], x_RS) and (back_RS[:, S:] == -1).all()
    for r, p in enumerate(plans):
        assert p.index_L.tolist() == [
            *range(r * chunk, (r + 1) * chunk),
            *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk),
        ]
    # Causal load balance: every rank's queries see as many keys (pairs q >= k) as every other's.
    pairs = [int((p.index_L + 1).sum()) for p in plans]
    assert len(set(pairs)) == 1


def _attend_all_ranks(q, k, v, doc_RS, cp):
    """The backend on each of `cp` ranks, its key/value gather done in this process."""
    S = q.shape[1]
    out = torch.empty_like(q)
    for r in range(cp):
        plan = shard_plan(S, cp, r)
        full_k, full_v = (_pad(x, plan.S_pad)[:, plan.order_P] for x in (k, v))
        gathered = iter([full_k, full_v])
        plan.gather_kv = lambda x, it=gathered: next(it)
        out_L = CPAttention(plan, doc_RS).attend(0, plan.shard(q), plan.shard(k), plan.shard(v))
        keep = plan.index_L < S
        out[:, plan.index_L[keep]] = out_L[:, keep]
    return out


def _pad(x, S_pad):
    return torch.cat([x, x.new_zeros(x.shape[0], S_pad - x.shape[1], *x.shape[2:])], dim=1)


@pytest.mark.parametrize("cp,query_block", [(2, 512), (4, 512), (2, 4), (4, 2)])
def test_cp_attention_matches_causal_sdpa_float64(cp, query_block, monkeypatch):
    """Whole shards and shards in query blocks (each block's mask inside a checkpoint)."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", query_block)
    g = torch.Generator().manual_seed(0)
    R, S, H, Hkv, D = 2, 24, 4, 2, 8
    q = torch.randn(R, S, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(R, S, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    # 23 slots: not a multiple of 2 x cp, so the shards carry padding.
    q23, k23, v23 = q[:, :23], k[:, :23], v[:, :23]
    want = F.scaled_dot_product_attention(
        q23.transpose(1, 2), k23.transpose(1, 2), v23.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    got = _attend_all_ranks(q23, k23, v23, torch.zeros(R, 23, dtype=torch.long), cp)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # Packed rows: documents of 5, 9, 7 inputs and trailing padding; positions restart per document.
    layout = pack_layout([6, 10, 8, 3], 25, rows=[[0, 1, 2], [3]])
    want = DocumentSDPA(layout.doc_RS).attend(0, q, k, v)
    got = _attend_all_ranks(q, k, v, layout.doc_RS, cp)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_cp_degrees_and_unsupported_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"cp \(2\)"):
        ParallelDims(1, 1, 1, 3, cp=2)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        ParallelDims(1, 1, 1, 1, cp=0)
    with pytest.raises(ValueError, match="expert parallelism"):
        ParallelDims(1, 2, 1, 4, ep=2, cp=2)
    assert ParallelDims(1, -1, 1, 8, cp=2).dp_shard == 4
    config = JobConfig()
    config.compile.enable = True
    with pytest.raises(ValueError, match=r"\[parallelism\] cp = 2 does not support compile.enable"):
        validate_cp(config, 2, moe=False)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        validate_cp(JobConfig(), 2, moe=True)
    validate_cp(config, 1, moe=True)


@pytest.fixture(scope="module")
def reference():
    out = {}
    for loss_agg, dtype in cp_worker.CASES:
        out[f"rl/{loss_agg}/{dtype}"] = cp_worker.run_case(None, loss_agg, dtype, 1, "rl")
    for dtype in ("float32", "float64"):
        out[f"sft/{dtype}"] = cp_worker.run_case(None, "token-mean", dtype, 1, "sft")
    return out


# The launches run in the background from collection on (helpers/background.py).
for _nproc, _layouts in LAUNCHES.items():
    background.register_torchrun(
        f"cp{_nproc}",
        ("tests/test_context_parallel.py::test_rl_update_under_cp_equals_one_rank",),
        WORKER,
        _nproc,
        lambda folder, layouts=_layouts: ["--layouts", ",".join(layouts), "--out", f"{folder}/results.pt"],
    )


@pytest.fixture(scope="module")
def launched():
    results = {}
    for nproc in LAUNCHES:
        folder = background.torchrun_result(f"cp{nproc}")
        results.update(torch.load(os.path.join(folder, "results.pt")))
    return results


def _assert_params(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


LAYOUTS = [layout for layouts in LAUNCHES.values() for layout in layouts]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_agg,dtype", cp_worker.CASES)
def test_rl_update_under_cp_equals_one_rank(launched, reference, layout, loss_agg, dtype):
    got, want, atol = launched[f"{layout}/rl/{loss_agg}/{dtype}"], reference[f"rl/{loss_agg}/{dtype}"], ATOL[dtype]
    assert got["losses"] == pytest.approx(want["losses"], abs=atol, rel=0)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], abs=atol, rel=0)
    for got_stats, want_stats in zip(got["stats"], want["stats"]):
        assert got_stats.keys() == want_stats.keys()
        for key in want_stats:  # sums over hundreds of tokens: relative
            assert got_stats[key] == pytest.approx(want_stats[key], rel=atol, abs=atol), key
    assert want["stats"][0]["update_tokens"] > 100 and want["stats"][0]["entropy"] > 0
    _assert_params(got["params"], want["params"], atol)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sft_step_under_cp_equals_one_rank(launched, reference, layout, dtype):
    got, want, atol = launched[f"{layout}/sft/{dtype}"], reference[f"sft/{dtype}"], ATOL[dtype]
    for a, b in zip(got["sft"], want["sft"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=atol, rel=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=atol, rel=0)
    assert want["sft"][1]["loss"] < want["sft"][0]["loss"]
    _assert_params(got["params"], want["params"], atol)


@pytest.mark.multirank
def test_cp_ranks_holding_different_rows_stop_with_an_error(launched):
    """2 and 4 ranks: one rank's rows differ, and every rank raises (none trains on a mix)."""
    assert launched["diverged_raises"]


SFT_CONFIG = os.path.join(REPO_ROOT, "train_configs", "sft_reverse_debug.toml")
SFT_ARGS = [
    f"--job.config_file={SFT_CONFIG}",
    "--training.steps=3",
    "--training.batch_size=8",
    "--data.num_eval_samples=8",
    "--metrics.eval_freq=0",
    "--metrics.log_freq=1",
    "--lr_scheduler.warmup_steps=1",
    "--checkpoint.interval=1",
    "--checkpoint.keep_latest_k=0",
    "--checkpoint.export_hf=false",
]


def _sft_steps(folder) -> dict[int, dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


@pytest.mark.multirank
def test_cp2_checkpoint_resumes_with_cp1(tmp_path):
    """A job on 2 ranks with cp = 2 (the real Trainer and SFT recipe) saves every step; the step-1
    checkpoint resumed on 1 rank (cp = 1) continues with the losses and gradient norms of the
    uninterrupted cp = 2 run (float32: 1e-5 relative, as tests/test_checkpoint_resharding.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cp2, resumed = tmp_path / "cp2", tmp_path / "cp1"
    proc = run_cmd(train_cmd([*SFT_ARGS, f"--job.dump_folder={cp2}", "--parallelism.cp=2"], nproc=2), env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "cp=2" in proc.stdout
    step1 = cp2 / "checkpoint" / "step-1"
    proc = run_cmd(train_cmd([*SFT_ARGS, f"--job.dump_folder={resumed}", f"--checkpoint.load_path={step1}"]), env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"resumed from {step1}" in proc.stdout
    got, want = _sft_steps(resumed), _sft_steps(cp2)
    assert sorted(got) == [2, 3] and sorted(want) == [1, 2, 3]
    for step in (2, 3):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    assert want[3]["loss"] < want[1]["loss"]


background.register(
    "bench_long_context",
    ("tests/test_context_parallel.py::test_bench_gpu_long_context_entry_dry_run",),
    lambda folder: ["bash", os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh"), "--long-context-only", "--dry-run"],
    {"PYTHONPATH": REPO_ROOT},
)  # in the background from collection on (helpers/background.py)


@pytest.mark.multirank
def test_bench_gpu_long_context_entry_dry_run():
    """scripts/bench_gpu.sh --long-context-only --dry-run: the 32k entry's code path on 2 gloo
    ranks (cp = 2, the debug model, 512 tokens) prints its JSON line."""
    proc, _ = background.result("bench_long_context", timeout_s=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])["long_context"]
    assert line["cp"] == 2 and line["seq"] == 512 and line["tokens_per_s"] > 0


def test_kv_retrieval_task_asks_for_the_only_digit():
    import random

    from titanrl.data.tasks import build_task

    task = build_task("kv_retrieval")
    rng = random.Random(0)
    for _ in range(50):
        s = task.make(rng)
        document, asked = s.prompt[3:-1].split("|")
        pairs = dict(pair.split("=") for pair in document.split(";"))
        assert len(pairs) == 24 and pairs[asked] == s.answer and s.answer.isdigit()
        assert [v for v in pairs.values() if v.isdigit()] == [s.answer]
        assert task.score(f" {s.answer}", s.answer, {}).correct
        assert not task.score("12", s.answer, {}).well_formed
    with pytest.raises(ValueError, match="num_keys"):
        type(task)(num_keys=0)


ROLLOUT_WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "cp_rollout_worker.py")


for _nproc in (1, 2):
    background.register_torchrun(
        f"rollout_cp{_nproc}",
        ("tests/test_context_parallel.py::test_cp2_split_rollouts_equal_one_rank",),
        ROLLOUT_WORKER,
        _nproc,
        lambda folder: ["--out", f"{folder}/out.pt", "--folder", folder],
    )


@pytest.fixture(scope="module")
def rollout_runs():
    """cp_rollout_worker.py on 1 rank (cp = 1) and on 2 ranks (cp = 2): {world size: [rank files]}."""
    runs = {}
    for nproc in (1, 2):
        folder = background.torchrun_result(f"rollout_cp{nproc}")
        runs[nproc] = [torch.load(os.path.join(folder, f"out.pt.{r}"), weights_only=False) for r in range(nproc)]
    return runs


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["uneven", "dapo_one_prompt", "remax_baseline"])
def test_cp2_split_rollouts_equal_one_rank(rollout_runs, case):
    """A real job's two RL steps with cp = 2, each rank generating half of the prompt groups:
    the same completions (token ids, prompt and sample indices), rewards (and ReMax's baseline
    rewards), generated tokens, logged statistics (float32: 1e-5 relative) and parameters after
    the steps (1e-5) as one rank generating all."""
    want, got = rollout_runs[1][0][case], rollout_runs[2][0][case]
    assert got["generated"] == want["generated"]
    for got_m, want_m in zip(got["metrics"], want["metrics"], strict=True):
        assert got_m.keys() == want_m.keys()
        for key in want_m:
            assert got_m[key] == pytest.approx(want_m[key], rel=1e-5, abs=1e-6), key
    assert want["metrics"][0]["grad_norm"] > 0 and 0 < want["metrics"][0]["reward_mean"] < 1
    if case == "dapo_one_prompt":  # three rounds of one prompt: rank 1 has none in any of them
        assert [m["sampling_rounds"] for m in want["metrics"]] == [1, 3]
    _assert_params(got["params"], want["params"], 1e-5)


@pytest.mark.multirank
def test_cp2_ranks_generate_only_their_share(rollout_runs):
    """Decode tokens and prompts of each rank's generator: cp = 2 ranks split the reference's
    (3 prompts: 2 and 1; 1 prompt: all on rank 0, rank 1 never calls its generator)."""
    want = rollout_runs[1][0]
    ranks = [r["uneven"]["decoded"] for r in rollout_runs[2]]
    assert [prompts for _, prompts in ranks] == [4, 2]  # two steps of 2 and 1 prompts
    assert sum(tokens for tokens, _ in ranks) == want["uneven"]["decoded"][0]
    assert ranks[1][0] < ranks[0][0] < want["uneven"]["decoded"][0]
    dapo = [r["dapo_one_prompt"]["decoded"] for r in rollout_runs[2]]
    assert dapo[0] == want["dapo_one_prompt"]["decoded"] and dapo[1] == [0, 0]

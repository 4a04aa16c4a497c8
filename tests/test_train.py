"""The controller end to end: a few SFT + GRPO steps on 1 rank, 2 ranks (dp_shard=2) and tp=2,
with matching metrics; and bad input handled as documented."""

import json
import math
import os
import sys

import pytest
from helpers import background
from helpers.launch import REPO_ROOT, run_cmd, train_in_process
from helpers.tiny import smoke_run_args

from titanrl import train

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
SMALL = smoke_run_args()


def _metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run_single(folder, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "titanrl.train",
        *SMALL,
        f"--job.dump_folder={folder}",
        *extra,
    ]
    # tests/ on the path so that 'helpers.reward_fns:...' imports, in the trainer and its reward workers.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO_ROOT, "tests")}
    return run_cmd(cmd, env)


def _train_in_process(folder, extra=()) -> list[dict]:
    """The same job as `_run_single`, in this process (no interpreter start-up): its metrics."""
    train.main([*SMALL, f"--job.dump_folder={folder}", *extra])
    return _metrics(folder)


def _stops_at_start(folder, extra, capsys):
    """The job's rank entry point in this process, for a job that stops with a user error before
    it trains (exit code 2 and one line; the same code path as `_run_single`'s process)."""
    return train_in_process([*SMALL, f"--job.dump_folder={folder}", *extra], capsys)


def _rl_steps(metrics):
    return [m for m in metrics if m.get("phase") == "rl" and "reward_mean" in m]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    proc = _run_single(folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, _metrics(folder)


def test_single_rank_run_logs_every_metric(single_rank):
    stdout, metrics = single_rank
    steps = _rl_steps(metrics)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for key in [
        "reward_mean",
        "reward_std",
        "accuracy",
        "response_len",
        "kl",
        "entropy",
        "clip_frac",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "time_generate",
        "time_reward",
        "time_train",
        "time_sync",
        "peak_mem_gb",
        "gen_logprob_diff",
        "ratio_max",
        "mem_generate_gb",
        "mem_train_gb",
        "mem_sync_gb",
        "gen_compile_s",
    ]:
        assert key in steps[0], key
    # Time-slicing: the 2048-block KV pool is released before training; the generator's blocks
    # are touched only when used, so the resident memory during generation is not far above.
    assert all(0.1 < m["mem_train_gb"] < 4 and 0.1 < m["mem_generate_gb"] < 4 for m in steps)
    # On-policy single update: the importance ratio is exactly 1 and nothing is clipped.
    assert all(m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0 for m in steps)
    # Generator and trainer logprobs of the sampled tokens agree to float32 rounding.
    assert all(m["gen_logprob_diff"] < 1e-5 for m in steps)
    assert "eval_accuracy" in steps[-1]
    assert "rl: eval_accuracy" in stdout


TAIL = ("response_len_p50", "response_len_p90", "response_len_max")


LAYOUTS = {"dp_shard2": ["--parallelism.dp_shard=2"], "tp2": ["--parallelism.tp=2", "--parallelism.dp_shard=1"]}


# In the background from collection on (helpers/background.py).
background.register_train_jobs(
    "train_two_ranks",
    ("tests/test_train.py",),
    lambda folder: [[*SMALL, f"--job.dump_folder={folder}/{name}", *layout] for name, layout in LAYOUTS.items()],
    2,
)


@pytest.fixture(scope="module")
def two_ranks():
    """The job of `single_rank` on 2 ranks in each of LAYOUTS (one launch): {layout: folder}."""
    folder = background.torchrun_result("train_two_ranks")
    return {name: os.path.join(folder, name) for name in LAYOUTS}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_rank(two_ranks, single_rank, layout):
    _, ref = single_rank
    tmp_path = two_ranks[layout]
    got = _rl_steps(_metrics(tmp_path))
    want = _rl_steps(ref)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        # Same prompts and samples on any layout: rewards match exactly, update numbers closely.
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6)
        assert g["accuracy"] == pytest.approx(w["accuracy"], abs=1e-6)
        assert g["response_len"] == pytest.approx(w["response_len"], abs=1e-6)
        # The tail over ranks (dp 2: gathered with the balance plan's costs) is one rank's.
        assert [g[k] for k in TAIL] == [w[k] for k in TAIL]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)
        assert g["entropy"] == pytest.approx(w["entropy"], rel=1e-3)
    if layout == "dp_shard2":  # training.balance_tokens moved groups between the ranks
        assert sum(g["moved_groups"] for g in got) > 0
        assert all(g["rank_tokens_imbalance"] <= g["rank_tokens_imbalance_before"] for g in got)


def test_kl_to_reference_starts_at_zero_then_grows(tmp_path):
    steps = _rl_steps(_train_in_process(tmp_path, ["--algorithm.kl_coef=0.05", "--optimizer.lr=3e-3"]))
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy as RL starts
    assert steps[-1]["kl"] > 1e-4


def test_off_policy_epochs_and_minibatches(tmp_path):
    """2 epochs x 2 mini-batches with micro-batches: later updates see ratios != 1 (old logprobs)."""
    steps = _rl_steps(
        _train_in_process(
            tmp_path,
            [
                "--algorithm.ppo_epochs=2",
                "--algorithm.num_minibatches=2",
                "--optimizer.lr=3e-3",
                "--training.micro_batch_tokens=24",
            ],
        )
    )
    assert len(steps) == 3 and any(m["ratio_max"] != 1.0 for m in steps)


def test_sft_warmup_micro_batches_match_one_batch(tmp_path):
    """Warm-up SFT accumulates micro-batches of training.micro_batch_tokens: the loss after one
    update equals one forward per step."""
    losses, micro_batches = [], []
    for name, extra in [("one", []), ("micro", ["--training.micro_batch_tokens=48"])]:
        args = ["--sft_warmup.steps=2", "--sft_warmup.batch_size=16", "--training.steps=0", *extra]
        logged = [m for m in _train_in_process(tmp_path / name, args) if "sft_loss" in m]
        assert len(logged) == 1
        micro_batches.append(logged[0]["sft_micro_batches"])
        losses.append(logged[0]["sft_loss"])
    assert micro_batches[0] == 1 and micro_batches[1] >= 3, micro_batches
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_bad_data_row_fails_fast_with_the_line(tmp_path, capsys):
    """JSONL data row without 'prompt' -> fails before the model is built, naming file:line and the field"""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": 2}\n{"answer": 3}\n')
    proc = _stops_at_start(tmp_path, [f"--data.path={data}"], capsys)
    assert proc.returncode != 0
    assert "prompts.jsonl:2: missing or empty 'prompt'" in proc.stderr


def test_config_typo_fails_with_suggestion(tmp_path, capsys):
    """Config key typo -> fails naming the key and the closest valid one"""
    proc = _stops_at_start(tmp_path, ["--algorithm.group_sise=4"], capsys)
    assert proc.returncode != 0
    assert "Unknown config key 'algorithm.group_sise'" in proc.stderr and "Did you mean 'group_size'" in proc.stderr


def test_failing_user_reward_function_is_isolated_and_counted(tmp_path):
    """User reward function raising, returning NaN or hanging inside a real run -> the run finishes; failures counted in reward_failures"""
    extra = ["--reward.function=helpers.reward_fns:flaky", "--reward.timeout_s=2", "--reward.failure_reward=-1.0"]
    steps = _rl_steps(_train_in_process(tmp_path, extra))  # the run finishes: no exception
    assert len(steps) == 3
    assert sum(m["reward_failures"] for m in steps) > 0
    assert all(math.isfinite(m["reward_mean"]) for m in steps)


def test_unimportable_reward_function_is_a_clear_error(tmp_path, capsys):
    proc = _stops_at_start(tmp_path, ["--reward.function=no_such_module:fn"], capsys)
    assert proc.returncode == 2
    assert "reward.function 'no_such_module:fn' cannot be imported" in proc.stderr


def test_batch_invariant_mode_gives_exactly_on_policy_logprobs(tmp_path):
    """With batch-invariant kernels, the trainer's logprobs of the sampled tokens equal the
    generator's bit for bit in a real run (the logged mean |diff| is exactly 0)."""
    steps = _rl_steps(_train_in_process(tmp_path, ["--generator.batch_invariant=true"]))
    assert len(steps) == 3 and all(m["gen_logprob_diff"] == 0.0 for m in steps)


def test_jsonl_prompts_with_numeric_verifier_run_end_to_end(tmp_path, capsys):
    """A user's JSONL prompts (GSM8K-style numeric answers): eval rows held out, SFT on 'solution', GRPO runs."""
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i, "solution": f"#### {2 * i}"}) + "\n")
    steps = _rl_steps(_train_in_process(tmp_path, [f"--data.path={data}"]))
    assert len(steps) == 3 and steps[-1]["eval_samples"] == 8
    few = tmp_path / "few.jsonl"
    few.write_text(data.read_text().splitlines()[0] + "\n")
    proc = _stops_at_start(tmp_path / "b", [f"--data.path={few}"], capsys)
    assert proc.returncode == 2 and "not more than data.num_eval_samples" in proc.stderr

"""Every algorithm recipe in train_configs/ runs end to end (1 rank and 2 ranks), PPO's critic
resumes exactly, and the offline SFT -> DPO / reward model -> RL-with-reward-model chain works
on real files."""

import contextlib
import io
import json
import math
import os
import subprocess

import pytest
from helpers import background
from helpers.launch import REPO_ROOT, run_cmd, run_train_jobs, train_cmd, train_in_process
from helpers.tiny import smoke_run_args

from titanrl import train

SMALL = smoke_run_args(config=None, max_new_tokens=None)
# Algorithm-specific metrics each recipe must log.
RECIPES = {
    "ppo": ["value_loss", "value_clip_frac", "critic_grad_norm"],
    "rloo": ["is_dropped_frac"],
    "remax": ["greedy_reward"],
    "reinforce_pp": ["kl"],
    "dapo": ["sampling_rounds", "dropped_groups", "sampling_short_groups"],
    "gspo": [],
    "dr_grpo": [],
    "cispo": [],
    "sapo": [],
}
# The PPO recipe trains the critic alone for 5 steps; here for 1 (step 1 has no policy update).
# RLOO also runs with truncated importance sampling, to exercise the off-policy correction.
# ReMax runs with one sample per prompt, the setting its baseline is made for.
EXTRA = {
    "ppo": ["--critic.warmup_steps=1"],
    "rloo": ["--algorithm.off_policy_correction=tis"],
    "remax": ["--algorithm.group_size=1"],
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _config(name):
    return os.path.join(REPO_ROOT, "train_configs", f"{name}.toml")


def _train(recipe, folder, extra=(), nproc=1):
    """Run a recipe: on 1 rank in this process (no interpreter start-up), else under torchrun."""
    args = [f"--job.config_file={_config(recipe)}", f"--job.dump_folder={folder}", *extra]
    if nproc == 1:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            train.main(args)
        return subprocess.CompletedProcess(args, 0, out.getvalue(), "")
    cmd = train_cmd([*args], nproc)
    proc = run_cmd(cmd, ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rl_steps(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Each RL recipe, 3 steps on 1 rank: {recipe: metrics}."""
    out = {}
    for recipe in RECIPES:
        folder = tmp_path_factory.mktemp(recipe)
        _train(f"{recipe}_reverse_debug", folder, [*SMALL, *EXTRA.get(recipe, [])])
        out[recipe] = _rl_steps(folder)
    return out


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_runs_and_logs_its_metrics(one_rank, recipe):
    steps = one_rank[recipe]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        policy_updated = not (recipe == "ppo" and m["step"] == 1)
        assert math.isfinite(m["grad_norm"]) == policy_updated, m
        for key in ["reward_mean", "entropy", "mismatch_kl", "mismatch_ratio_max", *RECIPES[recipe]]:
            assert key in m and math.isfinite(m[key]), (key, m)
        # Generator and trainer logprobs agree to float32 rounding: the mismatch metrics say so.
        assert not policy_updated or m["gen_logprob_diff"] < 1e-5 and m["mismatch_ratio_max"] < 1.0 + 1e-4
    if recipe == "gspo":
        # Four mini-batches: later ones are off-policy and the 3e-4 clip range bites.
        assert any(m["clip_frac"] > 0 for m in steps)
    if recipe == "dapo":
        assert all(1 <= m["sampling_rounds"] <= 3 for m in steps)


# The calculator recipe (multi-turn tool use), on 1 rank and 2. Batch-invariant: on 2 ranks each
# generator decodes half the episodes, and with the ordinary kernels a row's logits depend in the
# last bits on its batch, enough to flip a sampled token on some machines (seen with Intel MKL);
# the comparison with 1 rank is about the environments, not that.
CALC = [*SMALL, "--generator.max_new_tokens=20", "--env.num_workers=1", "--generator.batch_invariant=true"]

# 2-rank layouts compared with 1 rank (id: recipe, layout).
TWO_RANKS = {
    "ppo-dp2": ("ppo", ["--parallelism.dp_shard=2"]),
    "ppo-tp2": ("ppo", ["--parallelism.tp=2", "--parallelism.dp_shard=1"]),
    "rloo-dp2": ("rloo", ["--parallelism.dp_shard=2"]),
    "remax-dp2": ("remax", ["--parallelism.dp_shard=2"]),
    # Advantages whitened over the global batch: the all-reduce must make 2 ranks equal 1.
    "reinforce_pp-dp2": ("reinforce_pp", ["--parallelism.dp_shard=2"]),
    # Mini-batches match across layouts when prompts per mini-batch divide by dp (4 / 2 / 2).
    "gspo-dp2": ("gspo", ["--parallelism.dp_shard=2", "--algorithm.num_minibatches=2"]),
    "dr_grpo-tp2": ("dr_grpo", ["--parallelism.tp=2", "--parallelism.dp_shard=1"]),
}


def _job(config: str, folder, extra) -> list[str]:
    return [f"--job.config_file={_config(config)}", f"--job.dump_folder={folder}", *extra]


# Every 2-rank RL run of this module in one torchrun launch: TWO_RANKS, DAPO's dynamic sampling
# and the calculator recipe (CALC), in the background from collection on (helpers/background.py).
TWO_RANK_JOBS = {
    **{
        case: (f"{recipe}_reverse_debug", [*SMALL, *EXTRA.get(recipe, []), *layout])
        for case, (recipe, layout) in TWO_RANKS.items()
    },
    "dapo-dp2": ("dapo_reverse_debug", [*SMALL, "--parallelism.dp_shard=2"]),
    "calculator-dp2": ("grpo_calculator_debug", [*CALC, "--parallelism.dp_shard=2"]),
}
background.register_train_jobs(
    "recipes_dp2",
    ("tests/test_recipes.py",),
    lambda folder: [_job(config, f"{folder}/{case}", extra) for case, (config, extra) in TWO_RANK_JOBS.items()],
    2,
)


@pytest.fixture(scope="module")
def two_rank_runs():
    """{id: folder} of TWO_RANK_JOBS."""
    folder = background.torchrun_result("recipes_dp2")
    return {case: os.path.join(folder, case) for case in TWO_RANK_JOBS}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_ranks_match_one_rank(tmp_path, two_rank_runs, one_rank, case):
    recipe, layout = TWO_RANKS[case]
    got, want = _rl_steps(two_rank_runs[case]), one_rank[recipe]
    if "--algorithm.num_minibatches=2" in layout:
        _train(f"{recipe}_reverse_debug", tmp_path / "one", [*SMALL, *EXTRA.get(recipe, []), layout[-1]])
        want = _rl_steps(tmp_path / "one")
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        # Same samples on any layout (seeded by global prompt id): identical rewards.
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6)
        assert g["response_len"] == pytest.approx(w["response_len"], abs=1e-6)
        assert g["entropy"] == pytest.approx(w["entropy"], rel=1e-3)
        if not math.isnan(w["grad_norm"]):
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)
        if recipe == "ppo":
            # Critic values, GAE whitened over the global batch, value loss: layout-independent.
            assert g["value_loss"] == pytest.approx(w["value_loss"], rel=1e-3, abs=1e-6)
            assert g["critic_grad_norm"] == pytest.approx(w["critic_grad_norm"], rel=1e-3)


def test_remax_greedy_sampling_has_zero_advantage(tmp_path):
    """Sampling greedily too, every sample equals its prompt's greedy baseline: the reward of the
    baseline matches the samples' exactly and the policy gradient is zero."""
    _train("remax_reverse_debug", tmp_path, [*SMALL, "--algorithm.group_size=1", "--generator.temperature=0"])
    steps = _rl_steps(tmp_path)
    assert len(steps) == 3
    for m in steps:
        assert m["greedy_reward"] == m["reward_mean"], m
        assert m["grad_norm"] == 0.0, m


@pytest.mark.multirank
def test_dapo_dynamic_sampling_on_two_ranks(two_rank_runs):
    steps = _rl_steps(two_rank_runs["dapo-dp2"])
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(1 <= m["sampling_rounds"] <= 3 and math.isfinite(m["grad_norm"]) for m in steps)


def test_ppo_critic_resumes_exactly(tmp_path):
    """PPO run stopped after step 2, same command re-run -> resumes; every step's policy and critic numbers (value loss, critic grad norm) are bit-identical to an uninterrupted run"""
    extra = [
        *smoke_run_args(config=None, steps=None, max_new_tokens=None),
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--critic.warmup_steps=1",
    ]
    full, parts = tmp_path / "full", tmp_path / "parts"
    _train("ppo_reverse_debug", full, [*extra, "--training.steps=4"])
    _train("ppo_reverse_debug", parts, [*extra, "--training.steps=2"])
    out = _train("ppo_reverse_debug", parts, [*extra, "--training.steps=4"])
    assert "resumed from" in out.stdout
    a = {m["step"]: m for m in _rl_steps(full)}
    b = {m["step"]: m for m in _rl_steps(parts)}
    for step in [1, 2, 3, 4]:
        for key in ["reward_mean", "value_loss", "critic_grad_norm", "entropy"]:
            assert a[step][key] == b[step][key], (step, key)
    # Critic warm-up: step 1 trains only the critic (no policy grad norm), later steps both.
    assert math.isnan(a[1]["grad_norm"]) and math.isfinite(a[2]["grad_norm"])


# ---- multi-turn tool use (CALC) ----


@pytest.fixture(scope="module")
def calculator_one_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calc")
    _train("grpo_calculator_debug", folder, CALC)
    return _rl_steps(folder)


def test_calculator_recipe_runs_multi_turn_episodes(calculator_one_rank):
    steps = calculator_one_rank
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["env_failures"] == 0 and 1.0 <= m["env_turns"] <= 3.0
        assert math.isfinite(m["grad_norm"]) and m["gen_logprob_diff"] < 1e-5


def test_calculator_with_ppo_places_per_turn_rewards(tmp_path):
    """Token-level algorithms on multi-turn episodes: PPO's critic and GAE over turns whose
    environment tokens are masked (per-turn rewards at each turn's last token)."""
    _train(
        "grpo_calculator_debug",
        tmp_path,
        [*CALC, "--training.steps=2", "--algorithm.name=ppo", "--critic.enable=true", "--sft_warmup.steps=30"],
    )
    steps = _rl_steps(tmp_path)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["env_turns"] > 1.0  # after 30 SFT steps the model calls the tool
        assert math.isfinite(m["value_loss"]) and math.isfinite(m["grad_norm"])


@pytest.mark.multirank
def test_calculator_recipe_two_ranks_match_one_rank(two_rank_runs, calculator_one_rank):
    for g, w in zip(_rl_steps(two_rank_runs["calculator-dp2"]), calculator_one_rank, strict=True):
        for key in ["reward_mean", "response_len", "env_turns"]:
            assert g[key] == pytest.approx(w[key], abs=1e-6), key
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)


# ---- offline recipes and reward models ----

OFFLINE = ["--data.num_eval_samples=32", "--metrics.log_freq=1"]


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft")
    out = _train(
        "sft_reverse_debug",
        folder,
        [
            *OFFLINE,
            "--training.steps=30",
            "--training.batch_size=32",
            "--metrics.eval_freq=30",
            "--checkpoint.interval=30",
        ],
    )
    first, last = (float(x) for x in out.stdout.split("eval_loss ")[1].split()[0:3:2])
    assert last < 0.6 * first, out.stdout[-2000:]
    assert os.path.exists(folder / "hf" / "model.safetensors")
    return folder / "hf"


def _offline_evals(folder, key="eval_margin") -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if key in r]


def test_dpo_increases_the_chosen_rejected_margin(tmp_path, sft_export):
    _train(
        "dpo_reverse_debug",
        tmp_path,
        [*OFFLINE, f"--model.hf_checkpoint={sft_export}", "--training.steps=12", "--metrics.eval_freq=12"],
    )
    evals = _offline_evals(tmp_path)
    assert evals[0]["eval_margin"] == 0.0  # policy == reference at the start
    assert evals[-1]["eval_margin"] > 0.05 and evals[-1]["eval_pref_accuracy"] > 0.6, evals


OFFLINE_KEYS = {
    "dpo_reverse_debug": "eval_margin",
    "sft_reverse_debug": "eval_loss",
    "reward_model_reverse_debug": "eval_margin",
}


def _offline_args(sft_export) -> list[str]:
    return [
        *OFFLINE,
        f"--model.hf_checkpoint={sft_export}",
        "--training.steps=4",
        "--metrics.eval_freq=4",
        "--training.batch_size=16",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
    ]


@pytest.fixture(scope="module")
def offline_two_ranks(tmp_path_factory, sft_export):
    """Each offline recipe of OFFLINE_KEYS on 2 ranks (one launch): {recipe: folder}. Two ranks
    also accumulate micro-batches: as many on each rank, pairs kept together."""
    folders = {recipe: tmp_path_factory.mktemp(f"{recipe}_two") for recipe in OFFLINE_KEYS}
    extra = [*_offline_args(sft_export), "--parallelism.dp_shard=2", "--training.micro_batch_tokens=128"]
    jobs = [_job(recipe, folder, extra) for recipe, folder in folders.items()]
    run_train_jobs(jobs, 2, tmp_path_factory.mktemp("offline_jobs"))
    return folders


@pytest.mark.multirank
@pytest.mark.parametrize("recipe", list(OFFLINE_KEYS))
def test_offline_two_ranks_match_one_rank(tmp_path, sft_export, offline_two_ranks, recipe):
    key = OFFLINE_KEYS[recipe]
    _train(recipe, tmp_path / "one", _offline_args(sft_export))
    one = _offline_evals(tmp_path / "one", key)
    two = _offline_evals(offline_two_ranks[recipe], key)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6)
    assert one[-1][key] != one[0][key]  # it trained


@pytest.mark.parametrize("recipe", ["sft_reverse_debug", "dpo_reverse_debug", "reward_model_reverse_debug"])
def test_offline_micro_batches_match_one_batch(tmp_path, sft_export, recipe):
    """Gradient accumulation over micro-batches of training.micro_batch_tokens (pairs kept
    together) gives the same losses, gradient norms and evaluations as one forward per step."""
    args = [
        *OFFLINE,
        f"--model.hf_checkpoint={sft_export}",
        "--training.steps=3",
        "--metrics.eval_freq=3",
        "--training.batch_size=16",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
    ]
    _train(recipe, tmp_path / "one", args)
    _train(recipe, tmp_path / "micro", [*args, "--training.micro_batch_tokens=128"])
    one, micro = (_offline_evals(tmp_path / d, "loss") for d in ("one", "micro"))
    assert [m["micro_batches"] for m in one] == [1, 1, 1]
    assert all(m["micro_batches"] >= 3 for m in micro), micro
    for a, b in zip(one, micro, strict=True):
        for key in ["loss", "grad_norm", "margin", "pref_accuracy"]:
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)
    evals = [
        _offline_evals(tmp_path / d, "eval_loss" if recipe.startswith("sft") else "eval_margin")
        for d in ("one", "micro")
    ]
    assert len(evals[0]) == len(evals[1]) == 2
    for a, b in zip(*evals):
        for key in ["eval_loss", "eval_margin", "eval_pref_accuracy"]:
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a, b)


def test_offline_recipes_read_jsonl_and_reject_bad_rows(tmp_path, sft_export, capsys):
    """Preference JSONL row without 'rejected' (offline DPO) -> exit code 2 before anything is built, naming file:line and the field"""
    sft_rows = [{"prompt": f"rev:{w}=", "answer": w[::-1]} for w in ["abc", "hgfe", "ijjd", "bead", "cab", "fig"]]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"][::-1]} for r in sft_rows]
    for name, rows in [("sft.jsonl", sft_rows), ("pairs.jsonl", pairs)]:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        "--data.num_eval_samples=2",
        "--training.steps=3",
        "--training.batch_size=2",
        "--metrics.eval_freq=3",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
    ]
    _train("sft_reverse_debug", tmp_path / "sft", [*common, f"--data.path={tmp_path / 'sft.jsonl'}"])
    assert len(_offline_evals(tmp_path / "sft", "eval_loss")) == 2
    _train(
        "dpo_reverse_debug",
        tmp_path / "dpo",
        [*common, f"--data.path={tmp_path / 'pairs.jsonl'}", f"--model.hf_checkpoint={sft_export}"],
    )
    assert len(_offline_evals(tmp_path / "dpo")) == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps(pairs[0]) + "\n" + json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    args = [
        f"--job.config_file={_config('dpo_reverse_debug')}",
        *common,
        f"--data.path={tmp_path / 'bad.jsonl'}",
        f"--job.dump_folder={tmp_path / 'bad'}",
    ]
    proc = train_in_process(args, capsys)  # a data error before any step: this process will do
    assert proc.returncode == 2 and "bad.jsonl:2: missing or empty 'rejected'" in proc.stderr, proc.stderr


@pytest.mark.multirank
def test_reward_model_trains_then_scores_rl_on_tp2(tmp_path, sft_export):
    """Bradley-Terry reward model from the SFT export, exported as *ForSequenceClassification,
    then used (weighted with the verifier) by GRPO on 1 rank and on tp=2: equal scores of the first
    step's samples (the same weights sample the same tokens), finite scores after. After an update
    the two layouts' weights differ in the last bits and a sampled token may differ (seen at step 3
    on an Intel MKL machine), which is the parallel parity tests' business, not the reward model's."""
    _train(
        "reward_model_reverse_debug",
        tmp_path / "rm",
        [*OFFLINE, f"--model.hf_checkpoint={sft_export}", "--training.steps=20", "--metrics.eval_freq=20"],
    )
    evals = _offline_evals(tmp_path / "rm")
    assert evals[-1]["eval_pref_accuracy"] > 0.6 and evals[-1]["eval_margin"] > evals[0]["eval_margin"]
    config = json.load(open(tmp_path / "rm" / "hf" / "config.json"))
    assert config["architectures"] == ["Qwen3ForSequenceClassification"]
    rl = [*SMALL, f"--reward.model_path={tmp_path / 'rm' / 'hf'}", "--reward.model_weight=0.5"]
    _train("grpo_reverse_debug", tmp_path / "one", rl)
    _train("grpo_reverse_debug", tmp_path / "tp", [*rl, "--parallelism.tp=2", "--parallelism.dp_shard=1"], nproc=2)
    one, tp = _rl_steps(tmp_path / "one"), _rl_steps(tmp_path / "tp")
    assert len(one) == len(tp) and all(math.isfinite(r["rm_score"]) for r in one + tp)
    assert one[0]["rm_score"] == pytest.approx(tp[0]["rm_score"], abs=1e-5)
    assert one[0]["reward_mean"] == pytest.approx(tp[0]["reward_mean"], abs=1e-5)

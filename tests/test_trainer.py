"""The Trainer and its recipes in-process (no subprocess): one RL step and one offline step
checked against independent computations; every recipe honours checkpoint.load_path, the
watchdog and training.on_nonfinite alike; the algorithm registry and a plug-in algorithm."""

import gc
import json
import math
import os
import sys
import weakref

import pytest
import torch
from helpers.launch import REPO_ROOT, run_cmd, train_cmd
from helpers.tiny import smoke_run_args

from titanrl import train
from titanrl.algorithms import ALGORITHMS, AdvantageInputs, get_algorithm, validate_algorithm
from titanrl.components import launch
from titanrl.config import load_config
from titanrl.models import Transformer
from titanrl.recipes.sft import demonstration
from titanrl.train import build_trainer
from titanrl.trainer import Trainer

CONFIGS = os.path.join(REPO_ROOT, "train_configs")
RL_SMALL = smoke_run_args(config=f"{CONFIGS}/grpo_reverse_debug.toml", steps=2, sft_steps=0, eval_samples=4)
OFFLINE_SMALL = [
    "--training.steps=4",
    "--training.batch_size=8",
    "--data.num_eval_samples=8",
    "--metrics.eval_freq=0",
    "--metrics.log_freq=1",
    "--checkpoint.export_hf=false",
]


def _offline_args(recipe, folder, *extra):
    # DPO and the reward model start from the flavor (no exported SFT model needed in-process).
    return [
        f"--job.config_file={CONFIGS}/{recipe}_reverse_debug.toml",
        f"--job.dump_folder={folder}",
        "--model.hf_checkpoint=",
        "--model.flavor=debug",
        *OFFLINE_SMALL,
        *extra,
    ]


def _rows(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_one_rl_step_in_process(tmp_path):
    """One GRPO step: the policy moves, on-policy ratios are exactly 1, generator and trainer
    logprobs agree, and the advantages the step trained on are GRPO's of its rewards."""
    trainer = build_trainer(load_config([*RL_SMALL, f"--job.dump_folder={tmp_path}"]))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen = {}
    advantages = trainer.recipe.algorithm.advantages
    trainer.recipe.algorithm.advantages = lambda inputs: seen.setdefault("out", (inputs, advantages(inputs)))[1]
    metrics = trainer.recipe.step(iter(trainer.recipe.loader), 1)
    trainer.close()
    inputs, out = seen["out"]
    r_PG = inputs.rewards_N.double().view(-1, 4)
    expected = ((r_PG - r_PG.mean(1, keepdim=True)) / (r_PG.std(1, keepdim=True) + 1e-6)).view(-1)
    torch.testing.assert_close(out.advantages.double(), expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward_mean"] == pytest.approx(inputs.rewards_N.mean().item(), rel=1e-6)
    assert metrics["ratio_max"] == 1.0 and metrics["gen_logprob_diff"] < 1e-5
    assert math.isfinite(metrics["grad_norm"]) and metrics["skipped_updates"] == 0
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved if torch.any(out.advantages != 0) else not moved


def test_bf16_on_one_rank_float32_master_weights_and_bitwise_generator_parity(tmp_path):
    """training.mixed_precision_param = bfloat16 without torchrun: FSDP2's policy over a one-rank
    group keeps float32 parameters and optimizer state, computes in bf16 (logprobs differ from a
    float32 forward of the same weights), the generator holds bf16 weights, and in batch-invariant
    mode sampler and trainer logprobs are bitwise equal. close() leaves no process group behind."""
    import torch.distributed as dist

    trainer = build_trainer(
        load_config(
            [
                *RL_SMALL,
                f"--job.dump_folder={tmp_path}",
                "--training.mixed_precision_param=bfloat16",
                "--generator.batch_invariant=true",
            ]
        )
    )
    metrics = trainer.recipe.step(iter(trainer.recipe.loader), 1)
    assert metrics["gen_logprob_diff"] == 0.0 and metrics["mismatch_kl"] == 0.0 and metrics["ratio_max"] == 1.0
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(v.dtype == torch.float32 for st in trainer.optimizer.state.values() for v in st.values() if v.dim())
    assert all(p.dtype == torch.bfloat16 for p in trainer.recipe.generator.model.parameters())
    tokens = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        bf16, _ = trainer.model.logprobs(tokens[:, :-1], tokens[:, 1:], 64)
        fp32_model = Transformer(trainer.model_args)
        fp32_model.load_state_dict({k: v.full_tensor() for k, v in trainer.model.state_dict().items()})
        fp32, _ = fp32_model.logprobs(tokens[:, :-1], tokens[:, 1:], 64)
    assert 1e-4 < (bf16 - fp32).abs().max() < 0.5
    trainer.close()
    assert not dist.is_initialized()


def test_one_sft_step_in_process_matches_a_float64_reference(tmp_path):
    """The SFT recipe's logged loss is the token-mean NLL of its batch, computed here in float64
    with the model's weights before the step."""
    trainer = build_trainer(load_config(_offline_args("sft", tmp_path)))
    samples = next(iter(trainer.recipe.loader))  # a fresh iterator yields the same first batch
    model64 = type(trainer.model)(trainer.model.args).double()
    model64.load_state_dict({k: v.double() for k, v in trainer.model.state_dict().items()})
    nll, count = 0.0, 0
    for s in samples:
        prompt, completion, mask = demonstration(trainer, s)
        tokens = torch.tensor([prompt + completion])
        logp = torch.log_softmax(model64(tokens[:, :-1]), -1)[0, len(prompt) - 1 :]
        nll -= sum(logp[t, c].item() * m for t, (c, m) in enumerate(zip(completion, mask)))
        count += sum(mask)
    metrics = trainer.recipe.step(iter(trainer.recipe.loader), 1)
    trainer.close()
    assert metrics["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert math.isfinite(metrics["grad_norm"]) and metrics["micro_batches"] == 1


def test_first_dpo_step_has_zero_margin_and_loss_log_2(tmp_path):
    """At step 1 the policy is its own reference: every implicit-reward margin is 0 and the DPO
    loss is exactly -log sigmoid(0) = log 2."""
    trainer = build_trainer(load_config(_offline_args("dpo", tmp_path)))
    metrics = trainer.recipe.step(iter(trainer.recipe.loader), 1)
    trainer.close()
    assert metrics["margin"] == 0.0 and metrics["pref_accuracy"] == 0.0
    assert metrics["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert math.isfinite(metrics["grad_norm"])


@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_offline_recipes_honour_checkpoint_load_path(tmp_path, recipe):
    """SFT / DPO run branched from a given checkpoint into a new folder (checkpoint.load_path) -> the branch's steps equal the original run's exactly"""
    first = tmp_path / "first"
    train.main(
        _offline_args(
            recipe, first, "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"
        )
    )
    branch = tmp_path / "branch"
    train.main(
        _offline_args(
            recipe, branch, "--checkpoint.enable=true", f"--checkpoint.load_path={first / 'checkpoint' / 'step-2'}"
        )
    )
    original = {r["step"]: r for r in _rows(first) if r["step"] > 2}
    branched = {r["step"]: r for r in _rows(branch)}
    assert sorted(branched) == [3, 4]
    for step, row in branched.items():
        assert row["loss"] == original[step]["loss"] and row["grad_norm"] == original[step]["grad_norm"]


@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_offline_recipes_honour_on_nonfinite(tmp_path, monkeypatch, recipe):
    """NaN loss in one SFT / DPO update -> 'skip' drops that update (grad_norm nan, the other steps finite); 'stop' ends the run naming the cause, as in RL"""
    monkeypatch.setenv("TITANRL_FAULT", "nan_loss:2:0")
    train.main(_offline_args(recipe, tmp_path / "skip", "--training.on_nonfinite=skip"))
    norms = [r["grad_norm"] for r in _rows(tmp_path / "skip") if "grad_norm" in r]
    assert math.isnan(norms[1]) and all(math.isfinite(n) for n in norms[:1] + norms[2:]), norms
    with pytest.raises(FloatingPointError, match="non-finite gradient norm in the .* update"):
        train.main(_offline_args(recipe, tmp_path / "stop", "--training.on_nonfinite=stop"))


def test_offline_recipe_hang_is_reported_by_the_watchdog(tmp_path):
    """An SFT step that hangs -> the watchdog exits the rank (code 3) naming rank and phase."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITANRL_FAULT": "hang_train:2:0"}
    proc = run_cmd(
        [sys.executable, "-m", "titanrl.train", *_offline_args("sft", tmp_path), "--job.phase_timeout_s=5"],
        env,
        timeout_s=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "titanrl watchdog: rank 0 stuck in phase 'train'" in proc.stderr


# ---- the algorithm registry ----


def test_registry_names_and_errors():
    assert set(ALGORITHMS) == {"grpo", "rloo", "remax", "reinforce_pp", "gspo", "cispo", "sapo", "ppo"}
    with pytest.raises(ValueError, match=r"unknown name 'grpoo'.*Did you mean 'grpo'"):
        validate_algorithm(load_config(["--algorithm.name=grpoo"]))
    with pytest.raises(ValueError, match=r"'torch:Tensor' is not a subclass of .*Algorithm"):
        get_algorithm("torch:Tensor")
    with pytest.raises(ValueError, match=r"'no_such_module:X' cannot be imported"):
        validate_algorithm(load_config(["--algorithm.name=no_such_module:X"]))


def test_plugin_algorithm_loads_validates_and_computes(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "tests"))
    cls = get_algorithm("helpers.plugin_algorithms:MaxBaseline")
    name = "--algorithm.name=helpers.plugin_algorithms:MaxBaseline"
    with pytest.raises(ValueError, match="'max_baseline' needs group_size >= 2"):
        validate_algorithm(load_config([name, "--algorithm.group_size=1"]))
    # Its own setting: typos get did-you-mean, its own check runs, a value reaches the class.
    with pytest.raises(ValueError, match=r"'algorithm.max_baseline.margn'. Did you mean 'margin'"):
        validate_algorithm(load_config([name, "--algorithm.max_baseline.margn=1"]))
    with pytest.raises(ValueError, match=r"margin must be >= 0"):
        validate_algorithm(load_config([name, "--algorithm.max_baseline.margin=-1"]))
    config = load_config([name, "--algorithm.group_size=2", "--algorithm.max_baseline.margin=0.5"])
    validate_algorithm(config)
    algo = cls(config.algorithm)
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    out = algo.advantages(AdvantageInputs(rewards, torch.ones(4, 3), None, None, None, None, None))
    torch.testing.assert_close(out.advantages, torch.tensor([-2.5, -0.5, -0.5, -0.5]))


@pytest.mark.multirank
def test_plugin_algorithm_trains_under_torchrun_on_two_ranks(tmp_path):
    """algorithm.name = 'helpers.plugin_algorithms:MaxBaseline' (defined in tests/, not in titanrl) runs
    a 2-rank GRPO-style job: both ranks compute its advantages every step."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TITANRL_TEST_PLUGIN_LOG": str(tmp_path / "plugin"),
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")]),
    }
    cmd = train_cmd(
        [
            *RL_SMALL,
            f"--job.dump_folder={tmp_path}",
            "--algorithm.name=helpers.plugin_algorithms:MaxBaseline",
            "--algorithm.max_baseline.margin=0.25",
            "--parallelism.dp_shard=2",
        ],
        2,
    )
    proc = run_cmd(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"plugin.{rank}").read_text().split()
        # 2 prompts x 4 samples per rank, all advantages <= 0, the setting from the command line
        assert lines == ["8", "True", "0.25"] * 2
    steps = [r for r in _rows(tmp_path) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["grad_norm"]) for r in steps)


def test_launch_run_frees_the_runs_model_before_the_interpreter_exits(tmp_path, monkeypatch):
    """The entry point's run leaves its model in reference cycles (hooks, FSDP state that holds
    process groups); `launch.run` collects them when `main` returns instead of leaving them to
    the interpreter's teardown (where a rank of a finished 2-rank run was seen to abort)."""
    models = []
    close = Trainer.close

    def close_and_watch(self):
        models.append(weakref.ref(self.model))
        close(self)

    monkeypatch.setattr(Trainer, "close", close_and_watch)
    monkeypatch.setattr(sys, "argv", ["train", *_offline_args("sft", tmp_path, "--training.steps=1")])
    gc.disable()  # only launch.run's own collection may free the cycles
    try:
        launch.run(train.main)
        assert len(models) == 1 and models[0]() is None
    finally:
        gc.enable()

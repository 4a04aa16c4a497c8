"""The MoE recipe (train_configs/grpo_moe_reverse_debug.toml) runs end to end on one rank, with
routing replay as it ships and with `--moe.routing_replay=off`, and logs the held-out accuracy
and the MoE metrics every step."""

import contextlib
import io
import json
import math
import os

import pytest
from helpers.launch import REPO_ROOT
from helpers.tiny import smoke_run_args

from titanrl import train
from titanrl.config.manager import load_config
from titanrl.models import get_model_args

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_moe_reverse_debug.toml")
SMALL = smoke_run_args("--metrics.eval_freq=2", config=CONFIG, steps=2, sft_steps=3, max_new_tokens=None)
MOE_KEYS = ["moe_route_disagree", "moe_router_entropy", "moe_aux_loss", "moe_load_max_mean", "mismatch_kl"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The recipe, 2 RL steps after a 3-step warm-up, replay on (as shipped) and off: {mode: rows}."""
    out = {}
    for mode, extra in (("rollout", []), ("off", ["--moe.routing_replay=off"])):
        folder = tmp_path_factory.mktemp(mode)
        with contextlib.redirect_stdout(io.StringIO()):
            train.main([*SMALL, f"--job.dump_folder={folder}", *extra])
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            out[mode] = [json.loads(line) for line in f]
    return out


def test_recipe_is_an_eight_expert_top2_moe_with_replay():
    config = load_config([f"--job.config_file={CONFIG}"])
    args = get_model_args(config.model.flavor)
    assert config.model.flavor == "debug-moe" and (args.moe_num_experts, args.moe_top_k) == (8, 2)
    assert config.moe.routing_replay == "rollout" and config.data.task == "reverse"


@pytest.mark.parametrize("mode", ["rollout", "off"])
def test_recipe_runs_and_logs_accuracy_and_moe_metrics(runs, mode):
    rows = runs[mode]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # held-out accuracy at the start and the end
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    for m in steps:
        assert math.isfinite(m["grad_norm"]) and all(math.isfinite(m[k]) for k in MOE_KEYS), m
        assert 0.0 <= m["moe_route_disagree"] <= 1.0 and m["moe_aux_loss"] > 0
        assert 1.0 <= m["moe_load_max_mean"] <= 8.0 and all(f"moe_load_max_mean_l{i}" in m for i in range(3))
    if mode == "rollout":  # the trainer routes every (token, layer) as the generator did
        assert all(m["moe_route_disagree"] == 0.0 for m in steps)


def test_replay_on_and_off_sample_the_same_first_batch(runs):
    """Routing replay changes the update, not the rollout: step 1's samples are the same."""
    first = {mode: next(r for r in rows if r.get("step") == 1 and "reward_mean" in r) for mode, rows in runs.items()}
    assert first["rollout"]["reward_mean"] == first["off"]["reward_mean"]
    assert first["rollout"]["response_len"] == first["off"]["response_len"]

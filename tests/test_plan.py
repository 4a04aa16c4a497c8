"""`titanrl plan`: the report on a 256-GPU recipe, one line and exit code 2 for a plan that cannot
be built, and planned bytes against the bytes and peak measured on 1, 2 and 4 gloo ranks."""

import json
import os
import sys
import time

import pytest
from helpers import background
from helpers.launch import REPO_ROOT, cli_in_process

from titanrl.plan import device_bytes, plan_rank
from titanrl.plan.activations import Workload
from titanrl.plan.memory import GIB, plan_model_args

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
from plan_worker import ROWS, SEQ, case_config, cases_for  # noqa: E402  (the worker's own config)

RECIPE = os.path.join(REPO_ROOT, "train_configs", "grpo_qwen3_30b_a3b_256gpu.toml")
WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "plan_worker.py")
WORLDS = (1, 2, 4)
PEAK_TOLERANCE = 0.15
"""Planned update-step peak against the one `MemTracker` measures on the CPU ranks."""


def test_qwen3_30b_a3b_on_256_gpus_prints_memory_per_rank(capsys):
    start = time.perf_counter()
    out = cli_in_process(["plan", RECIPE, "--world", "256", "--gpu", "h100-80gb"], capsys)
    assert out.returncode == 0, out.stderr
    assert time.perf_counter() - start < 120
    for component in ("policy parameters", "policy optimizer state", "generator weights", "KV pool", "headroom"):
        assert component in out.stdout
    assert "rank 0" in out.stdout and "rank 255" in out.stdout
    assert "dp_shard=256 tp=1 ep=8" in out.stdout and "fits:" in out.stdout


def test_a_plan_that_cannot_be_built_is_one_line_and_exit_2(capsys):
    out = cli_in_process(["plan", RECIPE, "--world", "256", "--parallelism.tp=8"], capsys)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "titanrl plan: error: num_kv_heads 4 not divisible by tp 8: use tp in [1, 2, 4]"
    ]


def test_the_real_mesh_check_speaks_for_a_degree_the_world_cannot_hold(capsys):
    out = cli_in_process(["plan", RECIPE, "--world", "12", "--parallelism.dp_shard=8"], capsys)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "but the job runs on 12 ranks" in out.stderr


def test_a_plan_that_does_not_fit_names_the_fix(capsys):
    argv = ["plan", RECIPE, "--world", "8", "--parallelism.ep=1", "--activation_checkpoint.mode=none"]
    out = cli_in_process(argv, capsys)
    assert out.returncode == 1
    assert "does NOT fit" in out.stdout
    assert out.stdout.strip().splitlines()[-1].endswith("set activation_checkpoint.mode = 'full'")


def test_gpu_names_and_sizes():
    assert device_bytes("h100-80gb") == 81559 << 20
    assert device_bytes("24") == 24 * GIB
    with pytest.raises(ValueError, match="--gpu 'a100' is neither"):
        device_bytes("a100")


def test_uneven_shards_make_the_last_rank_smaller():
    # 151,936 vocabulary rows over 256 ranks: 594 a rank, the last holds 466 (padded to 594 in
    # storage), so rank 255's optimizer state (unpadded) is smaller than rank 0's.
    config = case_config("dense")
    config.model.flavor = "qwen3-0.6b"
    args = plan_model_args(config)
    first, last = (plan_rank(config, args, 256, r, 80 * GIB, Workload(SEQ, 0)) for r in (0, 255))
    assert first.policy.params == last.policy.params
    assert first.policy.optimizer > last.policy.optimizer


# The launches run in the background from collection on (helpers/background.py).
for _world in WORLDS:
    background.register_torchrun(
        f"plan{_world}",
        (f"tests/test_plan.py::test_planned_bytes_equal_measured[{_world}]",),
        WORKER,
        _world,
        lambda folder: ["--out", folder],
    )


def _measured(world: int) -> dict[int, dict]:
    folder = background.torchrun_result(f"plan{world}")
    by_rank = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)}
    return {r: {c["case"]: c for c in results} for r, results in by_rank.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("world", WORLDS)
def test_planned_bytes_equal_measured(world):
    measured = _measured(world)
    for rank, cases in measured.items():
        assert sorted(cases) == sorted(cases_for(world))
        for name, m in cases.items():
            config = case_config(name)
            plan = plan_rank(config, plan_model_args(config), world, rank, 80 * GIB, Workload(SEQ, 0))
            where = f"{name} on rank {rank} of {world}"
            assert plan.update_tokens == ROWS * SEQ // config.parallelism.cp  # cp ranks split the rows
            assert (plan.policy.params, plan.policy.grads, plan.policy.optimizer) == (
                m["params"],
                m["grads"],
                m["optimizer"],
            ), where
            # The worker trains no generator: its copy is not part of the measured peak.
            peak = plan.update_peak() - (plan.generator_weights or 0)
            assert abs(peak - m["peak"]) <= PEAK_TOLERANCE * m["peak"], (where, peak, m["peak"])


def test_suggest_lists_fitting_meshes_fastest_first(capsys):
    out = cli_in_process(["plan", RECIPE, "--world", "8", "--gpu", "h200-141gb", "--suggest"], capsys)
    assert out.returncode == 0, out.stderr
    listed = [line for line in out.stdout.splitlines() if line.startswith("  dp_replicate=")]
    assert listed and "step-time model (titanrl/plan/suggest.py): ideal roofline" in out.stdout
    seconds = [float(line.split("step ~")[1].split(" s")[0]) for line in listed]
    assert seconds == sorted(seconds)
    # ep must divide the 128 experts and dp_shard; tp must divide the 4 KV heads.
    for line in listed:
        degrees = dict(kv.split("=") for kv in line.split("step")[0].split())
        assert 128 % int(degrees["ep"]) == 0 and 4 % int(degrees["tp"]) == 0


def test_help(capsys):
    out = cli_in_process(["plan", "--help"], capsys)
    assert out.returncode == 0 and out.stdout.startswith("usage: titanrl plan CONFIG.toml --world N")
    assert "fake process group" in out.stdout


DEBUG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")


def test_run_preflight_refuses_a_job_that_cannot_fit(capsys, tmp_path):
    dump = f"--job.dump_folder={tmp_path}"
    argv = ["run", "--nproc", "16", DEBUG, dump, "--preflight.device_memory_gb=0.01"]
    out = cli_in_process(argv, capsys)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titanrl: error: [preflight] the job does not fit 16 devices")
    assert "--preflight.plan=off skips this check" in lines[0]


def test_run_preflight_plans_only_large_launches_unless_asked(tmp_path):
    from titanrl import cli

    tiny = ["--preflight.device_memory_gb=0.01", f"--job.dump_folder={tmp_path}"]
    cli.preflight([f"--job.config_file={DEBUG}", *tiny], 8)  # 'auto': 8 ranks are not planned
    cli.preflight([f"--job.config_file={DEBUG}", *tiny, "--preflight.plan=off"], 16)
    with pytest.raises(ValueError, match=r"\[preflight\] the job does not fit 2 devices"):
        cli.preflight([f"--job.config_file={DEBUG}", *tiny, "--preflight.plan=on"], 2)
    roomy = ["--preflight.device_memory_gb=80", f"--job.dump_folder={tmp_path}"]
    assert cli.preflight([f"--job.config_file={DEBUG}", *roomy], 16).preflight.plan == "auto"


def test_scaling_page_is_generated_from_the_plan():
    """docs/scaling.md: its header and, for a subset (the whole page takes minutes on 2 cores),
    the rows `scripts/gen_scaling_docs.py` renders now; every flavor has its section."""
    from scripts.gen_scaling_docs import FLAVORS, HEADER, PAGE, page_rows, render

    text = PAGE.read_text()
    assert text.startswith(HEADER)
    assert all(f"## {flavor}\n" in text for flavor in FLAVORS)
    for flavor, world in (("qwen3-8b", 8),):
        rows = page_rows(text, flavor, world)
        assert rows and rows == page_rows(render((flavor, world)), flavor, world)


@pytest.mark.parametrize(
    "overrides, reference, critic",
    [({}, False, False), ({"kl_coef": 0.1}, True, False), ({"name": "ppo"}, False, True)],
)
def test_the_models_a_config_adds_beside_the_policy(overrides, reference, critic):
    config = case_config("dense")
    for key, value in overrides.items():
        setattr(config.algorithm, key, value)
    config.critic.enable = critic
    plan = plan_rank(config, plan_model_args(config), 2, 0, 80 * GIB, Workload(SEQ, 0))
    assert (plan.reference is not None, plan.critic is not None) == (reference, critic)
    if reference:  # a frozen float32 copy of the policy's shards: no gradients, no optimizer state
        assert (plan.reference.params, plan.reference.grads, plan.reference.optimizer) == (plan.policy.params, 0, 0)
    if critic:  # the policy's body with its own one-label head (the debug policy ties its LM head)
        assert plan.critic.params == plan.policy.params + 1 * 256 * 4  # rank 0's row of the [1, 256] head
        assert plan.critic.grads == plan.critic.params and plan.critic.optimizer > plan.critic.params
    assert plan.generator_weights is not None  # two ranks: FSDP2 shards, so the generator has its own copy

"""scripts/seed_table.py's table: mean and min-max over seeds per evaluation step, the reward
windows, the SmolLM2 pass@j columns, and --table-only on dump folders of synthetic runs."""

import importlib.util
import json
import os

import pytest
from helpers.launch import REPO_ROOT

_spec = importlib.util.spec_from_file_location("seed_table", os.path.join(REPO_ROOT, "scripts", "seed_table.py"))
seed_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seed_table)


def write_run(folder, evals: dict[int, dict], rewards: list[float], before_sft: float | None = 0.0) -> None:
    """A metrics.jsonl as the RL recipe logs it: the before-SFT eval, SFT rows, RL rows, evals."""
    os.makedirs(folder, exist_ok=True)
    rows = [{"step": -5, "phase": "sft", "eval_accuracy_before_sft": before_sft}] if before_sft is not None else []
    rows += [{"step": s, "phase": "sft", "sft_loss": 1.0} for s in range(-4, 1)]
    for step in range(len(rewards) + 1):  # step 0's eval is a row of its own, later ones join their step's
        row = {"step": step, "phase": "rl", "reward_mean": rewards[step - 1], "accuracy": 0.1} if step else {}
        if step in evals:
            row.update({"step": step, "phase": "rl", "eval_samples": 64.0, "eval_reward_failures": 0.0, **evals[step]})
        rows += [row] if row else []
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_rows_are_mean_and_range_over_seeds(tmp_path):
    rewards = {0: [0.1] * 10 + [0.5] * 10, 1: [0.2] * 10 + [0.3] * 10, 2: [0.3] * 10 + [0.4] * 10}
    accs = {0: (0.2, 0.4), 1: (0.25, 0.5), 2: (0.15, 0.3)}
    for seed in rewards:
        evals = {0: {"eval_accuracy": accs[seed][0]}, 20: {"eval_accuracy": accs[seed][1]}}
        write_run(tmp_path / f"seed{seed}", evals, rewards[seed])
    table, numbers = seed_table.build_table(seed_table.read_seeds(str(tmp_path), [0, 1, 2]))
    assert table.splitlines()[:5] == [
        "| GRPO step | eval_accuracy |",
        "|---|---|",
        "| before SFT warm-up | 0.000 (0.000-0.000) |",
        "| 0 | 0.200 (0.150-0.250) |",
        "| 20 | 0.400 (0.300-0.500) |",
    ]
    assert numbers["rows"][2]["eval_accuracy"] == pytest.approx({"mean": 0.4, "min": 0.3, "max": 0.5})
    assert numbers["reward"]["first"] == pytest.approx({"mean": 0.2, "min": 0.1, "max": 0.3})
    assert numbers["reward"]["last"] == pytest.approx({"mean": 0.4, "min": 0.3, "max": 0.5})
    assert "0.200 (0.100-0.300) -> 0.400 (0.300-0.500)" in table


def test_suite_pass_at_j_columns_without_per_source_ones(tmp_path):
    """The SmolLM2 recipe's evals: greedy accuracy, then each suite's overall pass@1 / pass@4."""
    for seed, shift in ((0, 0.0), (1, 0.1)):
        evals = {
            10: {
                "eval_accuracy": 0.6 + shift,
                "eval/short_answer/pass@1": 0.5 + shift,
                "eval/short_answer/pass@4": 0.7 + shift,
                "eval/short_answer/mean@4": 0.5 + shift,
                "eval/short_answer/capital/pass@1": 0.3,
            }
        }
        write_run(tmp_path / f"seed{seed}", evals, [0.5] * 10, before_sft=None)
    table, _ = seed_table.build_table(seed_table.read_seeds(str(tmp_path), [0, 1]))
    assert (
        table.splitlines()[0] == "| GRPO step | eval_accuracy | eval/short_answer/pass@1 | eval/short_answer/pass@4 |"
    )
    assert table.splitlines()[2] == "| 10 | 0.650 (0.600-0.700) | 0.550 (0.500-0.600) | 0.750 (0.700-0.800) |"


def test_a_redone_step_counts_once_and_a_missing_eval_is_an_error(tmp_path):
    write_run(tmp_path / "seed0", {0: {"eval_accuracy": 0.2}, 20: {"eval_accuracy": 0.4}}, [0.1] * 20)
    with open(tmp_path / "seed0" / "metrics.jsonl", "a") as f:  # a resumed run redoes step 20
        f.write(json.dumps({"step": 20, "phase": "rl", "eval_accuracy": 0.6}) + "\n")
    write_run(tmp_path / "seed1", {0: {"eval_accuracy": 0.2}}, [0.1] * 5)  # stopped before step 20
    one = seed_table.read_seeds(str(tmp_path), [0])
    assert one[0]["evals"] == {0: {"eval_accuracy": 0.2}, 20: {"eval_accuracy": 0.6}}
    assert "| 20 | 0.600 |" in seed_table.build_table(one)[0]
    with pytest.raises(ValueError, match=r"seed 1 has no evaluation at step\(s\) \[20\]"):
        seed_table.build_table(seed_table.read_seeds(str(tmp_path), [0, 1]))
    write_run(tmp_path / "seed5", {}, [0.1] * 5)
    with pytest.raises(ValueError, match="no held-out evaluation"):
        seed_table.build_table(seed_table.read_seeds(str(tmp_path), [5]))
    with pytest.raises(ValueError, match="seed2/metrics.jsonl: run the seeds first"):
        seed_table.read_seeds(str(tmp_path), [2])


def test_table_only_writes_the_json_and_keeps_the_run_facts(tmp_path, capsys):
    for seed in (3, 4):
        write_run(tmp_path / f"seed{seed}", {0: {"eval_accuracy": 0.1 * seed}}, [0.2] * 12)
    out = tmp_path / "table.json"
    out.write_text(json.dumps({"command": "python scripts/seed_table.py --seeds 3 4", "run_seconds": {"3": 9.0}}))
    seed_table.main(["--seeds", "3", "4", "--dump-root", str(tmp_path), "--out", str(out), "--table-only"])
    record = json.loads(out.read_text())
    assert record["command"] == "python scripts/seed_table.py --seeds 3 4"
    assert record["run_seconds"] == {"3": 9.0}
    assert record["per_seed"]["4"]["evals"] == {"0": {"eval_accuracy": pytest.approx(0.4)}}
    assert record["rows"][1]["eval_accuracy"] == pytest.approx({"mean": 0.35, "min": 0.3, "max": 0.4})
    assert record["table_markdown"] in capsys.readouterr().out
    assert record["cpu"] and record["torch"]

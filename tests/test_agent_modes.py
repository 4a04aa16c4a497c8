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

from helpers.launch import cli_in_process, train_metrics  # noqa: E402
from test_agent_endpoint import (  # noqa: E402, F401
    ARGS,
    MAX_NEW,
    REPO_ROOT,
    TESTS,
    EosModel,
    TurnScript,
    char_tokens,
    checkpoint,
    folder,
)

from titanrl.config import load_config  # noqa: E402
from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.data.encode import PromptEncoder  # noqa: E402
from titanrl.data.tasks import Sample  # noqa: E402
from titanrl.evaluate import EvalHost  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.models.chat_template import ChatTemplate  # noqa: E402
from titanrl.models.tokenizer import HFTokenizer  # noqa: E402
from titanrl.rewards.pass_at_k import pass_at_k  # noqa: E402
from titanrl.rl.agent_episodes import (  # noqa: E402
    build_agent_pool,
    play_agent_episodes,
    split_owners,
    split_samples,
    training_rows,
    with_split_rows,
)
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
    with open(os.path.join(REPO_ROOT, "train_configs", "grpo_agent_debug.toml")) as f:
        head = f.read().split("[agent]")[0]  # the suite_toml's agent instead
    config = suite_toml(tmp_path, "completions", head + '\n[data]\ntask = "reverse"\nnum_eval_samples = 2\n')
    args = [f"--job.config_file={config}", f"--job.dump_folder={tmp_path}", "--training.steps=1"]
    args += ["--sft_warmup.steps=0", "--training.batch_size=2", "--metrics.eval_freq=0"]
    args += ["--checkpoint.enable=false", "--checkpoint.export_hf=false", "--generator.num_blocks=256"]
    rows = [r for r in train_metrics(args, tmp_path) if "eval/tools/pass@1" in r]
    assert [r["step"] for r in rows] == [0, 1]
    want = {f"eval/tools/{k}": v for k, v in expected_metrics().items()}
    for r in rows:
        assert {k: v for k, v in r.items() if k.startswith("eval/")} == pytest.approx(want, abs=1e-12)


# ---- [agent] on_rewrite = "split" ----

THOUGHT, AFTER = "<think>hmm</think>Five.", "Done."


def play_drops_thought(folder, tmp_path, on_rewrite: str):  # noqa: F811
    """One episode of helpers.agent_fns:drops_thought on a model that writes THOUGHT, then AFTER:
    (prompts, completions, results, the model's two turns)."""
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'[model]\ntokenizer = "{folder}"\n[data]\ntask = "reverse"\nchat_template = true\n'
        f'[agent]\nfunction = "helpers.agent_fns:drops_thought"\nnum_workers = 1\non_rewrite = "{on_rewrite}"\n'
    )
    config = load_config([f"--job.config_file={toml}"])
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    turns = [char_tokens(tok, THOUGHT) + [tok.eos_id], char_tokens(tok, AFTER) + [tok.eos_id]]
    host = EvalHost(
        config, SimpleNamespace(dp_rank=0, dp_size=1), torch.device("cpu"), tok, PromptEncoder(tok), None, 0
    )
    gen = Generator(ARGS, GeneratorConfig(block_size=8, num_blocks=512), torch.device("cpu"), tokenizer=tok)
    gen.model = TurnScript(turns, ARGS.vocab_size, tok.encode("<|im_start|>assistant\n"))
    gen.wake()
    pool = build_agent_pool(config, template)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=1)
    try:
        sample = Sample("What is 2 plus 3?", "5", {})
        out = play_agent_episodes(pool, host, gen, lambda items: [], [sample], params, [0], template)
    finally:
        pool.close()
    return (*out[:3], turns)


def test_a_rewrite_splits_the_episode_into_two_token_exact_samples(folder, tmp_path):  # noqa: F811
    prompts, (c,), (result,), turns = play_drops_thought(folder, tmp_path, "split")
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    user = {"role": "user", "content": "What is 2 plus 3?"}
    assert prompts == [tok.encode(template.render([user], add_generation_prompt=True))]
    trained = lambda c: c.model_mask or [1] * len(c.token_ids)  # noqa: E731  (None: every token)
    assert c.token_ids == turns[0] and trained(c) == [1] * len(turns[0])  # what the model sampled
    ((prompt2, c2),) = split_samples(c)
    rewritten = [user, {"role": "assistant", "content": "Five."}, {"role": "user", "content": "Go on."}]
    assert prompt2 == tok.encode(template.render(rewritten, add_generation_prompt=True))  # what the template renders
    assert c2.token_ids == turns[1] and trained(c2) == [1] * len(turns[1])
    assert tok.encode(tok.decode(turns[0][:-1])) != turns[0][:-1]  # the model's tokens, not its text re-encoded
    assert result.failed is None and result.reward == 0.75  # one result: the episode's, for both samples
    row_prompts, rows = training_rows(prompts, [c], 1)
    assert row_prompts == [prompts[0], prompt2] and rows == [c, c2] and split_owners([c]) == [0]


def test_drop_fails_the_episode_that_rewrites_history(folder, tmp_path):  # noqa: F811
    _, (c,), (result,), turns = play_drops_thought(folder, tmp_path, "drop")
    assert split_samples(c) == [] and c.token_ids == turns[0]
    assert result.failed.startswith("rewrite") and result.reward == 0.0


def test_split_samples_train_with_their_episodes_advantage():
    adv_NT = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])  # rows 2, 3: split off episode 1, 0
    out = with_split_rows(adv_NT, mask_BT, [1, 0])
    assert out.tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, -0.5, -0.5], [0.5, 0.0, 0.0]]
    assert with_split_rows(adv_NT, mask_BT[:2], []) is adv_NT
    adv_N = torch.tensor([0.5, -0.5])  # per sequence (GRPO)
    assert with_split_rows(adv_N, mask_BT, [1, 0]).tolist() == [0.5, -0.5, -0.5, 0.5]


def train_agent(tmp_path, args: list[str]) -> list[dict]:
    """train_configs/grpo_agent_debug.toml for two GRPO steps with `args`: the steps' metrics."""
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_agent_debug.toml")
    args = [f"--job.config_file={config}", f"--job.dump_folder={tmp_path}", "--training.steps=2", *args]
    args += ["--sft_warmup.steps=0", "--training.batch_size=2", "--algorithm.group_size=2"]
    args += ["--data.num_eval_samples=2", "--metrics.eval_freq=0", "--generator.num_blocks=256"]
    args += ["--agent.timeout_s=600"]  # a loaded machine: the episodes wait for the generator
    args += ["--checkpoint.enable=false", "--checkpoint.export_hf=false"]
    return [r for r in train_metrics(args, tmp_path) if "reward_mean" in r]


@pytest.mark.slow  # ~40 s on 2 cores
def test_grpo_steps_train_the_split_samples(checkpoint, tmp_path):  # noqa: F811
    """Every episode's harness rewrites history once: each step's 4 episodes are 8 samples, the
    split ones counted; none failed."""
    args = ["--agent.function=helpers.agent_fns:drops_thought", "--agent.on_rewrite=split"]
    args += [f"--model.hf_checkpoint={checkpoint / 'model'}", f"--model.tokenizer={checkpoint / 'tokenizer'}"]
    args += ["--data.chat_template=true", "--model.max_seq_len=1024", "--generator.max_new_tokens=12"]
    args += ["--agent.max_total_tokens=200", "--agent.max_turns=3"]
    steps = train_agent(tmp_path, args)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["agent_splits"] == 4 and r["env_failures"] == 0 and r["reward_mean"] == 0.75 for r in steps), steps


@pytest.mark.slow  # ~30 s on 2 cores
def test_dynamic_sampling_drops_agent_groups_of_equal_rewards(tmp_path):
    """DAPO's dynamic sampling over agent episodes: groups whose rewards are all 0 (odd prompts)
    are dropped and more prompts drawn until the batch holds informative groups only."""
    args = ["--agent.function=helpers.agent_fns:parity_reward", "--rollout.dynamic_sampling=true"]
    steps = train_agent(tmp_path, [*args, "--rollout.max_sampling_rounds=8"])
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["dropped_groups"] for r in steps) > 0 and max(r["sampling_rounds"] for r in steps) > 1, steps
    assert all(r["sampling_short_groups"] == 0 and r["env_failures"] == 0 for r in steps), steps

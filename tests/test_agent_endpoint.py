"""Agents as users write them, against the OpenAI-compatible endpoint over the generator
(`titanrl/envs/agent_pool.py`, `agent_rollout.py`): a raw `openai` client loop, the OpenAI
Agents SDK and smolagents drive a scripted model at the real Qwen2.5 vocabulary and ChatML template through a
tool episode, and the sample is token for token the template's rendering of the conversation
with the model's own tokens for its turns (which differ from the encoding of their text, so a
re-tokenising endpoint fails); faults end only their episode, each with its counted reason."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from helpers import background, contained_envs  # noqa: E402
from helpers.agent_fns import ADD_TOOL  # noqa: E402
from helpers.launch import train_metrics  # noqa: E402
from helpers.real_vocab import write_qwen_layout_folder  # noqa: E402

from titanrl.config.agent import Agent  # noqa: E402
from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.envs.agent_pool import AgentPool  # noqa: E402
from titanrl.envs.agent_rollout import AgentRollout  # noqa: E402
from titanrl.envs.openai_endpoint import EndpointError, Served, parse_request  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.models import TransformerModelArgs  # noqa: E402
from titanrl.models.chat_template import ChatTemplate  # noqa: E402
from titanrl.models.tokenizer import HFTokenizer  # noqa: E402
from titanrl.rewards.runner import RewardResult, RewardStats  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS)

ARGS = TransformerModelArgs(
    family="qwen3", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32,
    vocab_size=151936, qk_norm=True, max_seq_len=1024,
)  # fmt: skip
MAX_NEW = 96
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    write_qwen_layout_folder(path)
    return str(path)


def char_tokens(tok, text: str) -> list[int]:
    """`text` one character per token: what a model may sample, never what encode(text) gives."""
    return [t for ch in text for t in tok.encode(ch)]


class TurnScript(nn.Module):
    """A 'model' that writes `turns[k]` in its k-th turn: the k-th time the fed tokens end with the
    generation prompt `opener`, the tokens after it are turns[k] (one sequence at a time)."""

    def __init__(self, turns: list[list[int]], vocab: int, opener: list[int]) -> None:
        super().__init__()
        self.turns, self.vocab, self.opener = turns, vocab, opener
        self.history: dict[int, int] = {}
        self.output = nn.Identity()

    def hidden_states(self, tokens_1N, positions_1N, backend):
        self.history.update(zip(positions_1N[0].tolist(), tokens_1N[0].tolist()))
        last, n = int(positions_1N[0, -1]), len(self.opener)
        ends = [
            p for p in sorted(self.history) if [self.history.get(q) for q in range(p - n + 1, p + 1)] == self.opener
        ]
        ends = [p for p in ends if p <= last]
        script = self.turns[min(len(ends) - 1, len(self.turns) - 1)] if ends else [0]
        logits = torch.full((1, tokens_1N.shape[1], self.vocab), -1e4)
        logits[0, :, script[min(last - ends[-1], len(script) - 1) if ends else 0]] = 0.0
        return logits

    def forward(self, tokens_1N, positions_1N, backend):
        return self.output(self.hidden_states(tokens_1N, positions_1N, backend))


def run_agent(folder, function, rows, model=None, temperature=1.0, **agent):
    """(prompts, completions, rollout, pool.refused) of one episode per row of agent `function`."""
    settings = Agent(function=function, num_workers=agent.pop("num_workers", 1), timeout_s=agent.pop("timeout_s", 60))
    pool = AgentPool(settings, Served("policy", temperature, 1.0, MAX_NEW))
    try:
        return (*run_on(pool, folder, rows, model, temperature), pool.refused)
    finally:
        pool.close()


def run_on(pool, folder, rows, model=None, temperature=1.0, max_turns=4):
    """(prompts, completions, rollout) of one episode per row on `pool`."""
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    gen = Generator(ARGS, GeneratorConfig(block_size=8, num_blocks=512), torch.device("cpu"), tokenizer=tok)
    if model is not None:
        gen.model = model
    rollout = AgentRollout(pool, tok, template, "hermes", max_turns, 400, -1.0, gen.eos_ids)
    prompts = rollout.start(rows, 1)
    gen.wake()
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature)
    try:
        completions, _ = gen.generate(prompts, params, turns=rollout)
    finally:
        rollout.finish()
    return prompts, completions, rollout


def expected_tokens(tok, template, messages, tools, turns):
    """The template's rendering of `messages` (assistant turns as the model's text), encoded
    between the assistant turns, with the model's own `turns` tokens for them: computed from the
    final rendering, not from the endpoint's turn-by-turn deltas."""
    text = template.render(messages, add_generation_prompt=False, tools=tools)
    out, pos = [], 0
    for message, ids in zip([m for m in messages if m["role"] == "assistant"], turns):
        start = text.index(message["content"], pos)
        between = tok.encode(text[pos:start])
        if out and between[:1] == [tok.eos_id]:  # the model's <|im_end|> ended its turn already
            between = between[1:]
        out += between + ids
        pos = start + len(message["content"])
    return out


FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "5"}}\n</tool_call>'
# Per harness: the module it needs, its system prompt, how it words the task and the tool's
# result, and the model's second turn (smolagents ends with its `final_answer` tool).
HARNESSES = {
    "openai_loop": ("openai", None, "{}", "tool", ANSWER),
    "agents_sdk": ("agents", "Use the add tool.", "{}", "tool", ANSWER),
    "smolagents_agent": ("smolagents", "Use the add tool, then call final_answer.", "New task:\n{}", "user", FINAL),
}


@pytest.mark.parametrize("function", list(HARNESSES))
def test_a_harness_drives_a_tool_episode_and_the_sample_is_token_exact(folder, function):
    module, system, task, result_role, last = HARNESSES[function]
    pytest.importorskip(module)
    tok = HFTokenizer(folder)
    turns = [char_tokens(tok, CALL) + [tok.eos_id], char_tokens(tok, last) + [tok.eos_id]]
    assert tok.encode(tok.decode(turns[0][:-1])) != turns[0][:-1]  # re-tokenising would change them
    rows = [{"prompt": "What is 2 plus 3?", "answer": "5", "metadata": {}}]
    (prompt,), (c,), rollout, _ = run_agent(
        folder,
        f"helpers.agent_fns:{function}",
        rows,
        TurnScript(turns, ARGS.vocab_size, tok.encode("<|im_start|>assistant\n")),
    )
    episode = rollout.episodes[(0, 0)]
    assert episode.failed is None and episode.reward == 1.0 and episode.turns == 2
    assert episode.tool_calls == (2 if last == FINAL else 1)
    template = ChatTemplate.from_folder(folder)
    result = {"role": result_role, "content": "5" if result_role == "tool" else "Observation:\n5"}
    messages = [*([{"role": "system", "content": system}] if system else []),
                {"role": "user", "content": task.format(rows[0]["prompt"])}, {"role": "assistant", "content": CALL},
                result, {"role": "assistant", "content": last}]  # fmt: skip
    # The harnesses' own tool schemas: compare the conversation after the tools section.
    tools = [ADD_TOOL] if function == "openai_loop" else rollout_tools(rollout)
    full = prompt + c.token_ids
    assert full == expected_tokens(tok, template, messages, tools, turns)
    # Only the model's tokens are in the loss: its two turns, eos included.
    model_ids = [t for t, m in zip(c.token_ids, c.model_mask) if m]
    assert model_ids == turns[0] + turns[1]


def rollout_tools(rollout):
    (conv,) = rollout._conv.values()
    return conv.tools


class EosModel(nn.Module):
    """A 'model' whose every turn is its end-of-turn token alone."""

    def __init__(self, eos: int, vocab: int) -> None:
        super().__init__()
        self.eos, self.vocab = eos, vocab
        self.output = nn.Identity()

    def forward(self, tokens_1N, positions_1N, backend):
        logits = torch.full((1, tokens_1N.shape[1], self.vocab), -1e4)
        logits[0, :, self.eos] = 0.0
        return logits

    hidden_states = forward


def reasons(rollout, modes):
    return {m: (rollout.episodes[(i, 0)].failed or "").split(":")[0] for i, m in enumerate(modes)}


def test_faults_end_only_their_episode_each_with_its_counted_reason(folder):
    modes = ["ok", "raises", "hangs", "unknown_model", "bad_tool_json", "rewrite", "wrong_key"]
    rows = [{"prompt": f"Task {i}", "answer": "", "metadata": {"mode": m}} for i, m in enumerate(modes)]
    tok = HFTokenizer(folder)
    _, completions, rollout, refused = run_agent(
        folder, "helpers.agent_fns:faulty", rows, EosModel(tok.eos_id, ARGS.vocab_size), timeout_s=4, num_workers=2
    )
    assert reasons(rollout, modes) == {
        "ok": "", "raises": "error", "hangs": "timeout", "unknown_model": "unknown_model",
        "bad_tool_json": "invalid", "rewrite": "rewrite", "wrong_key": "",
    }  # fmt: skip
    assert refused == 1  # the wrong key's call
    assert [rollout.episodes[(i, 0)].reward for i in range(len(modes))] == [1.0, -1, -1, -1, -1, -1, 1.0]
    assert len(completions) == len(modes)
    stats = RewardStats()
    stats.add_reward_results([RewardResult(e.reward, e.correct, e.failed) for e in rollout.episodes.values()])
    assert stats.reward_metrics() == {
        "reward_failures": 5, "reward_output_dropped_bytes": 0, "reward_failures_error": 1,
        "reward_failures_timeout": 1, "reward_failures_unknown_model": 1, "reward_failures_invalid": 1,
        "reward_failures_rewrite": 1,
    }  # fmt: skip


def test_an_agent_that_exits_or_blocks_its_worker_fails_alone_and_the_pool_goes_on(folder):
    tok = HFTokenizer(folder)
    model = EosModel(tok.eos_id, ARGS.vocab_size)
    pool = AgentPool(
        Agent(function="helpers.agent_fns:faulty", num_workers=3, timeout_s=5), Served("policy", 1.0, 1.0, MAX_NEW)
    )
    try:
        modes = ["exits", "blocks", "ok"]
        rows = [{"prompt": f"Task {i}", "answer": "", "metadata": {"mode": m}} for i, m in enumerate(modes)]
        _, _, rollout = run_on(pool, folder, rows, model)
        assert reasons(rollout, modes) == {"exits": "crash", "blocks": "timeout", "ok": ""}
        rows = [{"prompt": f"Task {i}", "answer": "", "metadata": {"mode": "ok"}} for i in range(3)]
        _, _, rollout = run_on(pool, folder, rows, model)  # on the replaced workers
        assert [e.reward for e in rollout.episodes.values()] == [1.0, 1.0, 1.0]
    finally:
        pool.close()


def test_requests_without_the_runs_key_are_refused(folder):
    import httpx

    pool = AgentPool(Agent(function="helpers.agent_fns:faulty", num_workers=1), Served("policy", 1.0, 1.0, MAX_NEW))
    try:
        assert httpx.get(pool.base_url + "/models").status_code == 401
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {pool.secret}"}  # the run's secret alone names no episode
        assert httpx.post(pool.base_url + "/chat/completions", json=body, headers=headers).status_code == 401
        assert pool.refused == 2
        assert pool.base_url.startswith("http://127.0.0.1:")
    finally:
        pool.close()


_RANK = (
    "import sys; from titanrl.config.agent import Agent; from titanrl.envs.agent_pool import AgentPool\n"
    "from titanrl.envs.openai_endpoint import Served\n"
    "pool = AgentPool(Agent(function='helpers.agent_fns:spawns_children', num_workers=2), Served('policy', 1, 1, 8))\n"
    "for e in range(2): pool.reset(next(pool.episode_ids), {'prompt': 'p', 'answer': '', 'metadata': {}})\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.parametrize("mode", ["cgroup", "subreaper"])
def test_nothing_the_agents_started_is_left_after_a_sigkill_of_the_rank(tmp_path, mode):
    """A rank SIGKILLed while its agents have left plain and `setsid` sleeps running -> none alive
    within 10 s (with the workers' cgroups, and with the subreaper fallback)."""
    env = {**os.environ, "AGENT_PID_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join([REPO_ROOT, TESTS])}
    if mode == "subreaper":
        env["TITANRL_NO_CGROUPS"] = "1"
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().startswith("agent workers contained by")
        assert rank.stdout.readline().strip() == "ready"
        assert contained_envs.alive_when_settled(str(tmp_path), 4) == 4
        rank.kill()
        rank.wait()
        assert contained_envs.alive_when_settled(str(tmp_path), 0) == 0
    finally:
        rank.kill()
        rank.wait()
        contained_envs.kill_leftovers(str(tmp_path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2-like checkpoint at the real vocabulary (and its tokenizer folder)."""
    from helpers.tiny import tiny_model

    from titanrl.models.hf import export_hf

    root = tmp_path_factory.mktemp("qwen_like")
    (root / "tokenizer").mkdir()
    write_qwen_layout_folder(root / "tokenizer")
    args = TransformerModelArgs(
        family="qwen2", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=151_936,
        qkv_bias=True, tie_word_embeddings=True, max_seq_len=1024,
    )  # fmt: skip
    export_hf(tiny_model(args, 0), str(root / "model"))
    return root


@pytest.mark.slow  # ~40 s on 2 cores
@pytest.mark.parametrize("function", list(HARNESSES))
def test_grpo_steps_through_the_trainer_with_an_agent_function(checkpoint, tmp_path, function):
    """train_configs/grpo_agent_debug.toml with a chat model and a real harness: two GRPO steps
    whose every episode ran through the endpoint, none failed."""
    pytest.importorskip(HARNESSES[function][0])
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_agent_debug.toml")
    args = [
        f"--job.config_file={config}",
        f"--job.dump_folder={tmp_path}",
        f"--agent.function=helpers.agent_fns:{function}",
    ]
    args += [f"--model.hf_checkpoint={checkpoint / 'model'}", f"--model.tokenizer={checkpoint / 'tokenizer'}"]
    args += ["--data.chat_template=true", "--model.max_seq_len=1024", "--generator.max_new_tokens=12"]
    args += ["--agent.max_total_tokens=200", "--agent.max_turns=3", "--training.steps=2", "--sft_warmup.steps=0"]
    args += [
        "--training.batch_size=2",
        "--algorithm.group_size=2",
        "--data.num_eval_samples=2",
        "--metrics.eval_freq=0",
    ]
    args += ["--checkpoint.enable=false", "--checkpoint.export_hf=false", "--generator.num_blocks=256"]
    steps = [r for r in train_metrics(args, tmp_path) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["env_failures"] == 0 and r["env_turns"] >= 1.0 and r["reward_failures"] == 0 for r in steps), steps


def test_text_completions_extend_by_text_and_a_none_reward_leaves_scoring_to_the_reward(folder):
    tok = HFTokenizer(folder)
    rows = [{"prompt": "Say ok.", "answer": "", "metadata": {}}]
    (prompt,), (c,), rollout, _ = run_agent(
        folder, "helpers.agent_fns:text_loop", rows, EosModel(tok.eos_id, ARGS.vocab_size)
    )
    assert prompt == tok.encode("Say ok.")
    assert c.token_ids == [tok.eos_id] + tok.encode("\nok\n") + [tok.eos_id]
    assert c.model_mask == [1] + [0] * len(tok.encode("\nok\n")) + [1]
    episode = rollout.episodes[(0, 0)]
    assert episode.failed is None and episode.score_transcript and episode.turns == 2


@pytest.mark.parametrize(
    "change,status,named",
    [
        ({"temperature": 0.7}, 400, "temperature 0.7"),
        ({"top_p": 0.5}, 400, "top_p 0.5"),
        ({"n": 2}, 400, "n 2"),
        ({"stream": True}, 400, "stream"),
        ({"stop": ["\n"]}, 400, "stop"),
        ({"max_tokens": 4}, 400, "max_tokens 4"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "gpt-5"}, 404, "gpt-5"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools"),
    ],
)
def test_what_the_policy_does_not_sample_is_a_400_naming_it(change, status, named):
    served = Served("policy", 1.0, 1.0, 16)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "max_tokens": 64}
    assert parse_request("chat", body, served).messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(EndpointError) as e:
        parse_request("chat", {**body, **change}, served)
    assert e.value.status == status and named in e.value.message


def _shipped_recipe(folder: str) -> list[str]:
    from helpers.launch import train_cmd

    args = ["--job.config_file=train_configs/grpo_agent_debug.toml", f"--job.dump_folder={folder}"]
    args += ["--training.steps=2", "--sft_warmup.steps=2", "--data.num_eval_samples=4", "--metrics.eval_freq=0"]
    return train_cmd(args)


background.register(
    "agent_recipe",
    ("tests/test_agent_endpoint.py::test_the_shipped_agent_recipe_runs",),
    _shipped_recipe,
    {"PYTHONPATH": REPO_ROOT},
)  # in the background from collection on (helpers/background.py)


@pytest.mark.slow  # ~25 s on 2 cores
def test_the_shipped_agent_recipe_runs():
    """train_configs/grpo_agent_debug.toml as the docs say, from the repository root: GRPO steps
    whose episodes ran train_configs/agent_reverse.py through the endpoint."""
    proc, folder = background.result("agent_recipe", timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [r for r in map(json.loads, open(folder / "metrics.jsonl")) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["env_failures"] == 0 for r in steps), steps


def test_a_call_past_max_turns_ends_the_sample_and_adds_no_tokens(folder):
    """The second call of a one-turn budget is refused (400 context_length_exceeded): the sample
    is the first turn alone; the agent raising at the refusal fails its episode ('error')."""
    tok = HFTokenizer(folder)
    call = char_tokens(tok, CALL) + [tok.eos_id]
    model = TurnScript([call], ARGS.vocab_size, tok.encode("<|im_start|>assistant\n"))
    pool = AgentPool(
        Agent(function="helpers.agent_fns:openai_loop", num_workers=1), Served("policy", 1.0, 1.0, MAX_NEW)
    )
    try:
        rows = [{"prompt": "What is 2 plus 3?", "answer": "5", "metadata": {}}]
        _, (c,), rollout = run_on(pool, folder, rows, model, max_turns=1)
    finally:
        pool.close()
    episode = rollout.episodes[(0, 0)]
    assert c.token_ids == call and episode.truncated and episode.turns == 1
    assert (
        episode.failed.startswith("error: the agent failed after its budget was spent")
        and "BadRequestError" in episode.failed
    )


@pytest.mark.parametrize(
    "function,message",
    [
        ("helpers.agent_fns:ADD_TOOL", "must be an async function"),
        ("helpers.no_such_module:run", "cannot be imported"),
    ],
)
def test_an_agent_function_that_cannot_run_is_a_one_line_error_at_start(function, message):
    with pytest.raises(ValueError, match=message):
        AgentPool(Agent(function=function, num_workers=1), Served("policy", 1.0, 1.0, MAX_NEW))


def test_agent_config_errors_name_the_key():
    for bad, key in [({"function": "no_colon"}, "function"), ({"on_rewrite": "keep"}, "on_rewrite"),
                     ({"tool_format": "tag"}, "tool_format"), ({"max_turns": 0}, "max_turns")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"\[agent\] {key}"):
            Agent(**{"function": "m:f", **bad}).validate()

    from titanrl.config import load_config

    config = os.path.join(REPO_ROOT, "train_configs", "grpo_agent_debug.toml")
    with pytest.raises(ValueError, match="unset env.name"):
        load_config([f"--job.config_file={config}", "--env.name=calculator", "--data.task=calculator"])
    with pytest.raises(ValueError, match=r"partial = true does not support .*\[agent\]"):
        load_config([f"--job.config_file={config}", "--rollout.partial=true", "--algorithm.off_policy_correction=tis"])
    from titanrl.rl.agent_episodes import agent_tool_format

    plain = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    with pytest.raises(
        ValueError, match=r"\[agent\] tool_format 'auto'.*set agent.tool_format to 'hermes' or 'llama3'$"
    ):
        agent_tool_format("auto", plain)

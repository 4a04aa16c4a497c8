"""Multi-turn environments: tool-call parsing, the built-in envs and sandbox, episodes driven
through the real paged generator (scripted and random models), KV reuse across turns, and
failing environments isolated per episode."""

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import contained_envs
from helpers.launch import REPO_ROOT
from helpers.reference import greedy_reference
from helpers.tiny import tiny_model, tiny_model_args
from torch import nn

from titanrl.components.containment import probe
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.envs.base import parse_json_call, parse_tool_call
from titanrl.envs.builtin import CalculatorEnv, CalculatorTask, GuessNumberEnv, GuessNumberTask, run_sandboxed
from titanrl.envs.multi_turn import MultiTurnRollout
from titanrl.envs.pool import EnvPool
from titanrl.generator import Generator, SamplingParams
from titanrl.models.tokenizer import ByteTokenizer

ARGS = tiny_model_args(tie_word_embeddings=False, hidden_dim=128, vocab_size=264, max_seq_len=256)
TOK = ByteTokenizer()


def test_tool_call_parsing():
    assert parse_tool_call("think <tool>1+2</tool>") == "1+2"
    assert parse_tool_call("<tool>a</tool> then <tool>b</tool>") == "b"
    assert parse_tool_call("<tool>unclosed") is None and parse_tool_call("no call") is None
    assert parse_json_call('{"name": "calc", "arguments": {"x": "1+2"}}') == ("calc", {"x": "1+2"})
    assert parse_json_call('{"name": "calc", "arguments": "{\\"x\\": 3}"}') == ("calc", {"x": 3})
    for bad in ['{"name": 3}', "not json", '{"arguments": {}}', '{"name": "f", "arguments": [1]}']:
        assert parse_json_call(bad) is None


def test_calculator_and_guess_envs_by_hand():
    env = CalculatorEnv()
    assert env.reset({"prompt": "p ", "answer": "148"}) == "p "
    assert env.step("<tool>4*37</tool>") == ("<result>148</result>", 0.0, False, {"tool_call": True})
    assert env.step("<tool>__import__('os')</tool>")[0] == "<result>error</result>"  # never eval
    for malformed in ["**3*1", "1/0", "9" * 70, "(" * 40]:
        assert env.step(f"<tool>{malformed}</tool>")[:3] == ("<result>error</result>", 0.0, False), malformed
    assert env.step("148") == ("", 1.0, True, {"correct": True})
    assert env.step("149")[1] == 0.0
    guess = GuessNumberEnv()
    guess.reset({"prompt": "g", "answer": "11"})
    assert guess.step("<tool>8</tool>")[:3] == ("<result>higher</result>", 0.0, False)
    assert guess.step("<tool>12</tool>")[:3] == ("<result>lower</result>", 0.0, False)
    assert guess.step("<tool>11</tool>")[1:3] == (1.0, True)
    # The demonstrations replay correctly against their envs.
    import random

    for task, env in [(CalculatorTask(), CalculatorEnv()), (GuessNumberTask(), GuessNumberEnv())]:
        sample = task.make(random.Random(3))
        env.reset({"prompt": sample.prompt, "answer": sample.answer})
        demo = sample.metadata["demo"]
        total = 0.0
        for k, (text, from_model) in enumerate(demo):
            if from_model:
                obs, reward, done, _ = env.step(text)
                total += reward
                if k + 1 < len(demo):
                    assert obs == demo[k + 1][0]
        assert total == 1.0


def test_python_sandbox_limits():
    """Tool code that imports, reaches attributes, opens files, allocates 10 GB or loops 10^12 times -> an 'error: ...' result for the model; the episode goes on"""
    assert run_sandboxed("sum(i**2 for i in range(1, 8))") == "140"
    assert run_sandboxed("__import__('os')").startswith("error: name '__import__'")
    assert run_sandboxed("().__class__").startswith("error: attribute access")
    assert run_sandboxed("open('/etc/passwd')") == "error: NameError"
    assert run_sandboxed("import os").startswith("error: syntax error")
    assert run_sandboxed("'x' * (10**10)", memory_mb=64) in ("error: memory limit", "error: MemoryError")
    assert run_sandboxed("sum(range(10**12))", timeout_s=1.0) in ("error: timeout", "error: killed")


class ScriptedModel(nn.Module):
    """A 'model' that always predicts script[position + 1] (probability 1)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.script, self.vocab = script, vocab
        # The scripted logits stand in for the hidden states; the output layer passes them on.
        self.output = nn.Identity()

    def hidden_states(self, tokens_1N, positions_1N, backend):
        nxt = [self.script[p + 1] if p + 1 < len(self.script) else 0 for p in positions_1N[0].tolist()]
        logits = torch.full((1, len(nxt), self.vocab), -1e4)
        logits[0, torch.arange(len(nxt)), torch.tensor(nxt)] = 0.0
        return logits

    def forward(self, tokens_1N, positions_1N, backend):
        return self.output(self.hidden_states(tokens_1N, positions_1N, backend))


def _rollout(pool, max_turns=4, max_total_tokens=250):
    return MultiTurnRollout(pool, TOK, max_turns=max_turns, max_total_tokens=max_total_tokens, failure_reward=-1.0)


def _encode_prompt(text):
    return [TOK.bos_id, *TOK.encode(text)]


def test_scripted_model_drives_a_calculator_episode_exactly():
    prompt = "4 boxes of 37 pens. pens? "
    call, result, answer = TOK.encode("<tool>4*37</tool>"), TOK.encode("<result>148</result>"), TOK.encode("148")
    script = _encode_prompt(prompt) + call + result + answer + [TOK.eos_id]
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=128), torch.device("cpu"), tokenizer=TOK)
    gen.model = ScriptedModel(script, ARGS.vocab_size)
    pool = EnvPool("calculator", num_workers=1)
    try:
        rollout = _rollout(pool)
        prompts = rollout.start([{"prompt": prompt, "answer": "148", "metadata": {}}], 1, _encode_prompt)
        gen.wake()
        completions, stats = gen.generate(
            prompts, SamplingParams(max_new_tokens=32, temperature=0.0, stop_strings=["</tool>"]), turns=rollout
        )
    finally:
        pool.close()
    (c,) = completions
    assert c.token_ids == call + result + answer + [TOK.eos_id]
    assert c.model_mask == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
    assert c.logprobs == [0.0] * len(c.token_ids)
    episode = rollout.episodes[(0, 0)]
    assert episode.rewards == [0.0, 1.0] and episode.turns == 2 and episode.tool_calls == 1 and episode.correct
    assert episode.failed is None
    # The prompt was prefilled once; the resumed turn prefilled the observation only.
    assert stats.prefill_tokens == len(prompts[0]) + len(result) and stats.resumed_turns == 1


def _split_turns(completion, prompt):
    """[(context before the turn, the turn's model tokens)] from a multi-turn completion."""
    turns, context, current = [], list(prompt), []
    for token, from_model in zip(completion.token_ids, completion.model_mask or [1] * len(completion.token_ids)):
        if from_model:
            current.append(token)
            continue
        if current:
            turns.append((list(context), current))
            context += current
            current = []
        context.append(token)
    if current:
        turns.append((list(context), current))
    return turns


def test_multi_turn_greedy_matches_full_recompute_without_re_prefill():
    model = tiny_model(ARGS, 0)
    model.eval()
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256), torch.device("cpu"))
    gen.load_weights(model)
    pool = EnvPool("helpers.env_fns:EchoEnv", {"turns": 3}, num_workers=2)
    texts = ["abc ", "hello world ", "x"]
    try:
        rollout = _rollout(pool)
        prompts = rollout.start([{"prompt": t, "answer": "", "metadata": {}} for t in texts], 2, _encode_prompt)
        gen.wake()
        completions, stats = gen.generate(
            prompts, SamplingParams(max_new_tokens=5, temperature=0.0, n=2), turns=rollout
        )
    finally:
        pool.close()
    obs = TOK.encode("<result>ok</result>")
    assert len(completions) == 6
    for c in completions:
        turns = _split_turns(c, prompts[c.prompt_index])
        assert len(turns) == 3 and c.model_mask.count(0) == 2 * len(obs)
        for context, tokens in turns:
            assert tokens == greedy_reference(model, context, 5)[0]
        assert rollout.episodes[(c.prompt_index, c.sample_index)].rewards == [0.25, 0.25, 1.0]
    # Each prompt prefilled once for its group; each resumed turn prefilled its observation only.
    assert stats.resumed_turns == 6 * 2
    assert stats.prefill_tokens == sum(len(p) for p in prompts) + 6 * 2 * len(obs)


def test_failing_environments_end_only_their_episode():
    """Environment raising in step or reset, hanging past its timeout, returning garbage or a NaN reward -> only that episode ends, with the failure reward and a recorded reason; the hung worker is replaced, the other episodes finish"""
    model = tiny_model(ARGS, 0)
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256), torch.device("cpu"))
    gen.load_weights(model)
    faults = ["", "raise", "hang", "garbage", "nan", "reset_raise", ""]
    pool = EnvPool("helpers.env_fns:FaultyEnv", num_workers=len(faults), timeout_s=3.0)
    try:
        rollout = _rollout(pool)
        samples = [{"prompt": f"q{i} ", "answer": "", "metadata": {"fault": f}} for i, f in enumerate(faults)]
        prompts = rollout.start(samples, 1, _encode_prompt)
        gen.wake()
        completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0), turns=rollout)
    finally:
        pool.close()
    assert len(completions) == len(faults)
    failed = {i: rollout.episodes[(i, 0)].failed for i in range(len(faults))}
    assert failed[0] is None and failed[6] is None
    assert failed[1].startswith("error: RuntimeError: boom")
    assert failed[2] == "timeout"
    assert failed[3].startswith("invalid: step() must return")
    assert failed[4].startswith("invalid: reward must be a finite number")
    assert failed[5].startswith("error: RuntimeError: boom at reset")
    for i in range(len(faults)):
        episode = rollout.episodes[(i, 0)]
        assert episode.reward == (1.0 if failed[i] is None else -1.0), (i, episode)
    assert pool.restarts == 1  # only the hung worker was replaced
    assert all(math.isfinite(lp) for c in completions for lp in c.logprobs)


# ---- containment: nothing an environment starts outlives its worker ----

CGROUPS = "cgroup" in probe()
MODES = [pytest.param("cgroup", marks=pytest.mark.skipif(not CGROUPS, reason="no writable cgroup here")), "subreaper"]


@pytest.fixture
def pid_dir(tmp_path, monkeypatch, request):
    folder = tmp_path / "pids"
    folder.mkdir()
    monkeypatch.setenv("TITANRL_TEST_PID_DIR", str(folder))
    if getattr(request, "param", "cgroup") == "subreaper":
        monkeypatch.setenv("TITANRL_NO_CGROUPS", "1")
    yield str(folder)
    contained_envs.kill_leftovers(str(folder))


def _run(pool, episode, op, payload):
    """Send one call and wait for its result."""
    getattr(pool, op)(episode, payload)
    (result,) = pool.poll(block=True)
    assert result.episode == episode
    return result


@pytest.mark.parametrize("pid_dir", MODES, indirect=True)
def test_env_children_setsid_and_daemons_die_with_their_workers(pid_dir):
    """Environment whose reset leaves a plain child, a `setsid` child and a double-forked daemon; its worker crashing, then hanging past env.timeout_s, then the pool closed -> 0 of them alive each time (cgroup: killed with the worker's cgroup; subreaper fallback: re-parented to the worker's keeper and killed from /proc)"""
    pool = EnvPool("helpers.contained_envs:SpawningEnv", num_workers=2, timeout_s=2.0)
    try:
        for episode in range(4):  # episodes 0 and 2 on worker 0, 1 and 3 on worker 1
            assert _run(pool, episode, "reset", {"prompt": "p"}).error is None
        assert contained_envs.alive_when_settled(pid_dir, 12) == 12
        assert _run(pool, 0, "step", "exit").error == "worker died"
        assert contained_envs.alive_when_settled(pid_dir, 6) == 6  # worker 1's, still running
        assert _run(pool, 1, "step", "hang").error == "timeout"
        assert contained_envs.alive_when_settled(pid_dir, 0) == 0
        assert pool.restarts == 2
        for episode in (4, 5):  # on the replacements
            assert _run(pool, episode, "reset", {"prompt": "p"}).error is None
        assert contained_envs.alive_when_settled(pid_dir, 6) == 6
        pool.close()
        assert contained_envs.alive_when_settled(pid_dir, 0) == 0
    finally:
        pool.close()


_RANK = (
    "import sys; from titanrl.envs.pool import EnvPool\n"
    "pool = EnvPool('helpers.contained_envs:SpawningEnv', num_workers=2)\n"
    "for e in range(4): pool.reset(e, {'prompt': 'p'})\n"
    "done = []\n"
    "while len(done) < 4: done += pool.poll(block=True)\n"
    "print([r.error for r in done], flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.parametrize("pid_dir", MODES, indirect=True)
def test_env_children_die_when_the_rank_is_sigkilled(pid_dir):
    """A rank process SIGKILLed while its environments have left plain, `setsid` and double-forked `sleep`s running -> 0 of them alive within 10 s (the keepers' parent-death signal)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")])}
    rank = subprocess.Popen(
        [sys.executable, "-c", _RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline().startswith("environment workers contained by")
        assert rank.stdout.readline().strip() == "[None, None, None, None]"
        assert contained_envs.alive_when_settled(pid_dir, 12) == 12
        rank.kill()
        rank.wait()
        assert contained_envs.alive_when_settled(pid_dir, 0) == 0
    finally:
        rank.kill()
        rank.wait()


def test_leaking_environment_fails_only_the_episodes_over_the_limit():
    """Environment keeping 100 MB more per step, memory_limit_mb = 250, episodes one after another on one worker while an earlier episode stays open -> only every third episode fails ('memory: MemoryError'); its worker is retired (a fresh one takes new episodes), so what it leaked fails no later episode, and the open episode finishes on it"""
    pool = EnvPool("helpers.contained_envs:LeakyEnv", num_workers=1, memory_limit_mb=250)
    try:
        assert _run(pool, 0, "reset", {"prompt": "p"}).error is None  # stays open on the first worker
        failed = []
        for episode in range(1, 7):
            assert _run(pool, episode, "reset", {"prompt": "p"}).error is None
            result = _run(pool, episode, "step", "100")
            failed.append(result.error)
            if result.error is None:
                pool.close_episode(episode)
        assert [f and f.split(":")[0] for f in failed] == [None, None, "memory"] * 2, failed
        assert "MemoryError" in failed[2]
        assert _run(pool, 0, "step", "0").error is None  # the retired worker finished what it held
        assert pool.restarts == 2
    finally:
        pool.close()


@pytest.mark.skipif("memory" not in probe(), reason="no cgroup memory controller here")
def test_env_worker_tree_over_its_memory_limit_is_killed_and_replaced():
    """Environment whose step has a child hold 90 MB while the worker takes 270 MB, memory_limit_mb = 300 (each under its own address-space limit, the tree over its cgroup's memory limit) -> the kernel kills the worker; that episode fails ('memory: ...', not 'worker died'), a fresh worker runs the next"""
    pool = EnvPool("helpers.contained_envs:TreeHogEnv", num_workers=1, memory_limit_mb=300, timeout_s=60.0)
    try:
        assert _run(pool, 0, "reset", {"prompt": "p"}).error is None
        assert _run(pool, 0, "step", "270 90").error.startswith("memory: the worker crossed its memory limit")
        assert _run(pool, 1, "reset", {"prompt": "p"}).error is None
        assert _run(pool, 1, "step", "10 10").error is None
    finally:
        pool.close()


def test_env_module_failing_at_import_is_one_line_with_file_and_line(tmp_path, monkeypatch):
    """env.name 'module:Class' whose module has a SyntaxError or raises at import -> ValueError of one line naming env.name, the file:line and the exception"""
    from titanrl.envs.pool import resolve_env

    (tmp_path / "broken_env_syntax.py").write_text("class Env:\n    def reset(self\n")
    (tmp_path / "broken_env_raises.py").write_text("x = 1\nraise RuntimeError('no sandbox here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, line, kind in (("broken_env_syntax", 2, "SyntaxError"), ("broken_env_raises", 2, "RuntimeError")):
        with pytest.raises(ValueError) as e:
            resolve_env(f"{module}:Env")
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"env.name '{module}:Env'")
        assert f"{module}.py:{line}: {kind}" in message

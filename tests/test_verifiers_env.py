"""verifiers environments (`verifiers.v1`) through `VerifiersEnvPool`: a real verifiers taskset, its
harness and its reward (tests/vf_plugins/vf_calculator.py: the calculator task as a verifiers
environment) played by titanrl's generator through `MultiTurnRollout`, faults named and counted,
and GRPO steps through the trainer."""

import json
import os
import sys

import pytest
import torch
from helpers.launch import REPO_ROOT, run_cmd, train_cmd
from helpers.real_vocab import write_qwen_layout_folder
from test_envs import ARGS, TOK, ScriptedModel

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.rewards_envs import Env
from titanrl.envs.multi_turn import MultiTurnRollout
from titanrl.envs.pool_builder import build_env_pool
from titanrl.generator import Generator, SamplingParams

pytest.importorskip("verifiers.v1")
PLUGINS = os.path.join(REPO_ROOT, "tests", "vf_plugins")
sys.path.insert(0, PLUGINS)  # verifiers imports a taskset by its id, the module's name
SAMPLE = {"prompt": "4 boxes of 37 pens. pens? ", "answer": "148", "metadata": {}}


@pytest.fixture(scope="module")
def pool():
    pool = build_env_pool(Env(name="calculator", verifiers="vf_calculator", timeout_s=10.0), 0)
    yield pool
    pool.close()


def _play(pool, sample: dict, turns: list[str]):
    """One episode of a scripted model that writes `turns` (the first ends at its stop string)."""
    encode = lambda text: [TOK.bos_id, *TOK.encode(text)]  # noqa: E731
    model_turns = [TOK.encode(t) for t in turns]
    script = encode(sample["prompt"]) + model_turns[0]
    if len(turns) > 1:
        script += TOK.encode("<result>148</result>") + model_turns[1]
    script += [TOK.eos_id]
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=128), torch.device("cpu"), tokenizer=TOK)
    gen.model = ScriptedModel(script, ARGS.vocab_size)
    rollout = MultiTurnRollout(pool, TOK, max_turns=4, max_total_tokens=250, failure_reward=-1.0)
    prompts = rollout.start([sample], 1, encode)
    gen.wake()
    params = SamplingParams(max_new_tokens=32, temperature=0.0, stop_strings=["</tool>"])
    (completion,), _ = gen.generate(prompts, params, turns=rollout)
    return completion, rollout.episodes[(0, 0)]


def test_verifiers_episode_end_to_end_gets_verifiers_reward(pool):
    """The harness's first request is the prompt; the model's tool call goes to the harness, whose
    result comes back as the next observation (masked out of the loss); the rollout's end gives
    the reward of the verifiers task's own @reward, 1 for the right answer and 0 for a wrong one."""
    call, result = TOK.encode("<tool>4*37</tool>"), TOK.encode("<result>148</result>")
    completion, episode = _play(pool, SAMPLE, ["<tool>4*37</tool>", "148"])
    answer = TOK.encode("148")
    assert completion.token_ids == call + result + answer + [TOK.eos_id]
    assert completion.model_mask == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
    assert episode.failed is None and episode.turns == 2 and episode.rewards == [0.0, 1.0] and episode.correct

    completion, episode = _play(pool, SAMPLE, ["<tool>4*37</tool>", "150"])
    assert episode.failed is None and episode.turns == 2 and episode.rewards == [0.0, 0.0] and not episode.correct
    completion, episode = _play(pool, SAMPLE, ["150"])  # no call: the harness ends at once
    assert episode.failed is None and episode.turns == 1 and episode.rewards == [0.0]


@pytest.mark.parametrize(
    "prompt, reason",
    [
        ("RAISE 4 boxes", "error: verifiers rollout: HarnessError: harness 'vf_calculator': RuntimeError: the "),
        ("HANG 4 boxes", "timeout"),
        ("REWRITE 4 boxes", "invalid: the harness rewrote the conversation"),
    ],
)
def test_a_failing_harness_fails_its_episode_with_a_named_reason(pool, prompt, reason):
    """A verifiers harness that raises, hangs past [env] timeout_s or edits the model's turns -> its
    episode gets the failure reward and a named reason (counted by its first word); the pool goes on."""
    pool.timeout_s = 2.0
    try:
        _, episode = _play(pool, {**SAMPLE, "prompt": prompt}, ["<tool>4*37</tool>", "148"])
    finally:
        pool.timeout_s = 10.0
    assert episode.failed is not None and episode.failed.startswith(reason), episode.failed
    assert episode.rewards == [-1.0]
    _, episode = _play(pool, SAMPLE, ["<tool>4*37</tool>", "148"])
    assert episode.failed is None and episode.rewards == [0.0, 1.0]


def test_verifiers_config_errors_are_one_line():
    with pytest.raises(ValueError, match=r"\[env\] verifiers = 'vf_calculator' runs its own harnesses"):
        Env(name="calculator", verifiers="vf_calculator", servers=1).validate()
    with pytest.raises(ValueError, match=r"\[env\] verifiers needs env.name"):
        Env(verifiers="vf_calculator").validate()
    with pytest.raises(ValueError, match=r"\[env\] verifiers = 'no_such_taskset' is not an installed verifiers"):
        build_env_pool(Env(name="calculator", verifiers="no_such_taskset"), 0)
    with pytest.raises(ValueError, match=r"returned dict, not a verifiers.v1.SingleAgentEnvConfig"):
        build_env_pool(Env(name="calculator", verifiers="vf_calculator:not_a_config"), 0)


@pytest.mark.slow  # ~40 s on 2 cores
def test_grpo_steps_through_the_trainer_against_a_verifiers_environment(tmp_path):
    """Two GRPO steps of the calculator recipe with its episodes played by the verifiers
    environment (named through a factory): every episode runs, none fails."""
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_calculator_server.toml")
    args = [f"--job.config_file={config}", f"--job.dump_folder={tmp_path}", "--env.servers=0"]
    args += ["--env.verifiers=vf_calculator:env_config", "--training.steps=2", "--sft_warmup.steps=4"]
    args += ["--sft_warmup.batch_size=8", "--training.batch_size=4", "--algorithm.group_size=4"]
    args += ["--data.num_eval_samples=8", "--reward.num_workers=1", "--metrics.eval_freq=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, PLUGINS]), "OMP_NUM_THREADS": "1"}
    proc = run_cmd(train_cmd(args), env, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "reward_mean" in r]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["env_failures"] == 0 and m["env_turns"] >= 1.0 for m in steps), steps


def test_tool_calls_in_the_model_format_reach_the_harness_as_openai_tool_calls():
    """With [env] tool_format 'hermes' and tools in the harness's request, the model's calls
    become OpenAI `tool_calls` that verifiers' chat dialect accepts; text and malformed calls
    stay text."""
    from verifiers.v1.dialects import DIALECTS

    from titanrl.envs.verifiers_pool import completion

    dialect = next(d for d in DIALECTS if d.upstream_path == "/chat/completions")
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "4*37"}}\n</tool_call>'
    raw = completion(text, "m", "hermes", has_tools=True)
    response = dialect.parse_response(dialect.validate_response(raw))
    (call,) = response.message.tool_calls
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "4*37"}
    assert response.finish_reason == "tool_calls"
    for args in [(text, "m", "tag", True), (text, "m", "hermes", False), ("<tool_call>{bad", "m", "hermes", True)]:
        response = dialect.parse_response(dialect.validate_response(completion(*args)))
        assert response.message.tool_calls is None and response.message.content == args[0]


def test_the_tools_a_harness_declares_reach_the_chat_template(pool, tmp_path):
    """A harness that sends `tools` in its requests: the prompt is rendered with those tools, as
    the chat template renders them (Qwen2.5's template at a real BPE vocabulary); without them
    the prompt has no tools section."""
    from titanrl.data.encode import PromptEncoder
    from titanrl.envs.builtin import CALCULATOR_TOOL
    from titanrl.models.chat_template import ChatTemplate
    from titanrl.models.tokenizer import HFTokenizer

    write_qwen_layout_folder(tmp_path)
    tok, template = HFTokenizer(str(tmp_path)), ChatTemplate.from_folder(str(tmp_path))
    for prompt, tools in (("TOOLS 4 boxes of 37 pens. pens? ", [CALCULATOR_TOOL]), (SAMPLE["prompt"], None)):
        rollout = MultiTurnRollout(pool, tok, 4, 400, prompt_encoder=PromptEncoder(tok, template))
        (ids,) = rollout.start([{**SAMPLE, "prompt": prompt}], 2)
        messages = [{"role": "user", "content": prompt}]
        assert tok._tok.decode(ids, skip_special_tokens=False) == template.render(messages, True, tools=tools)
        assert ("<tools>" in template.render(messages, True, tools=tools)) == (tools is not None)
        for eid in range(2):
            pool.close_episode(eid)

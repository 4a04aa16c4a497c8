"""The SmolLM2 tool-use recipe's parts (train_configs/grpo_smollm2_tool.toml): the `tool_multiply`
task, its agent (train_configs/agent_calculator.py) driving a tool episode through the endpoint,
SFT demonstrations rendered by the chat template, and the recipe run end to end at a tiny size on
a real BPE vocabulary with a ChatML template."""

import os
import random
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from helpers.launch import train_metrics  # noqa: E402
from test_agent_endpoint import REPO_ROOT, TurnScript, checkpoint, folder, run_agent  # noqa: E402,F401

from titanrl.data.encode import PromptEncoder  # noqa: E402
from titanrl.data.word_problems import CALCULATOR, ToolMultiply, final_answer, tool_call_text  # noqa: E402
from titanrl.models.chat_template import ChatTemplate  # noqa: E402
from titanrl.models.tokenizer import HFTokenizer  # noqa: E402
from titanrl.recipes.sft import demonstration  # noqa: E402

AGENT = os.path.join(REPO_ROOT, "train_configs", "agent_calculator.py") + ":run"


def factors(sample) -> tuple[int, int]:
    """(a, b) of a problem, read from its demonstrated calculator call 'a*b'."""
    a, b = sample.metadata["demo_messages"][0]["content"].split('"')[-2].split("*")
    return int(a), int(b)


def test_held_out_problems_are_never_trained_on():
    task = ToolMultiply()
    train = task.samples("train", 2000, 0)
    rng = random.Random(0)
    train += [task.make(rng) for _ in range(2000)]
    held_out = task.samples("eval", 200, 0)
    assert not {factors(s) for s in train} & {factors(s) for s in held_out}
    for s in train[:50] + held_out[:50]:
        a, b = factors(s)
        assert str(a * b) == s.answer and str(a) in s.prompt and str(b) in s.prompt
        assert 100 <= a <= 999 and 11 <= b <= 99
    assert final_answer("The answer is 44,384.") == "44384" and final_answer("no number") is None


def test_chat_demonstration_trains_the_assistant_turns_only(folder):  # noqa: F811
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    trainer = SimpleNamespace(tokenizer=tok, encode_prompt=PromptEncoder(tok, template))
    sample = ToolMultiply().samples("train", 1, 3)[0]
    prompt, completion, mask = demonstration(trainer, sample)
    assert prompt == trainer.encode_prompt(sample.prompt, sample.metadata)
    trained = tok.decode([t for t, m in zip(completion, mask) if m])
    untrained = tok.decode([t for t, m in zip(completion, mask) if not m])
    call = sample.metadata["demo_messages"][0]["content"]
    assert trained.startswith(call) and f"The answer is {sample.answer}." in trained
    assert sample.answer in untrained and "<tool_call>" not in untrained and "The answer" not in untrained
    whole = template.render(sample.metadata["messages"] + sample.metadata["demo_messages"])
    assert prompt + completion == tok.encode(whole)


def test_the_agent_calls_the_calculator_and_scores_the_final_answer(folder):  # noqa: F811
    """A scripted model calls the calculator with the problem's numbers and answers with the
    result; the agent (a raw openai loop) runs the call, sends the result, and rewards it."""
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    sample = ToolMultiply().samples("eval", 1, 0)[0]
    a, b = factors(sample)
    turns = [tok.encode(tool_call_text(f"{a} * {b}")), tok.encode(f"The answer is {a * b}.")]
    turns = [t + [tok.eos_id] for t in turns]
    opener = tok.encode("<|im_start|>assistant\n")
    model = TurnScript(turns, 151_936, opener)
    row = {"prompt": sample.prompt, "answer": sample.answer, "metadata": sample.metadata}
    prompts, completions, rollout, _ = run_agent(folder, AGENT, [row], model=model, temperature=0.0)
    episode = next(iter(rollout.episodes.values()))
    assert episode.failed is None and episode.rewards == [1.0] and episode.turns == 2
    text = tok.decode(completions[0].token_ids)
    assert f"<tool_response>\n{a * b}\n</tool_response>" in text  # the calculator's result (masked)
    tools = [CALCULATOR]  # the agent sends the schema; this template renders it in the system turn
    assert prompts[0] == template.encode(tok, sample.metadata["messages"], add_generation_prompt=True, tools=tools)


def test_the_tool_recipe_runs_sft_then_grpo_through_the_agent(checkpoint, tmp_path):  # noqa: F811
    """The shipped TOML at a tiny size (random model, real vocabulary and ChatML template):
    SFT on rendered demonstrations, then GRPO steps whose episodes all ran the calculator agent."""
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_smollm2_tool.toml")
    args = [f"--job.config_file={config}", f"--job.dump_folder={tmp_path}"]
    args += [f"--model.hf_checkpoint={checkpoint / 'model'}", f"--model.tokenizer={checkpoint / 'tokenizer'}"]
    args += ["--training.steps=1", "--training.batch_size=2", "--algorithm.group_size=2", "--sft_warmup.steps=2"]
    args += ["--sft_warmup.batch_size=4", "--data.num_eval_samples=2", "--metrics.eval_freq=1"]
    args += ["--generator.max_new_tokens=8", "--checkpoint.enable=false", "--checkpoint.export_hf=false"]
    args += ["--model.max_seq_len=1024", "--agent.max_total_tokens=64"]  # Qwen's template renders the tools
    sys.path.insert(0, REPO_ROOT)
    rows = train_metrics(args, tmp_path)
    sft = [r for r in rows if "sft_loss" in r]
    steps = [r for r in rows if "reward_mean" in r]
    assert sft and all(r["sft_loss"] > 0 for r in sft)
    assert [r["step"] for r in steps] == [1]
    assert all(r["env_failures"] == 0 and r["env_turns"] >= 1.0 for r in steps), steps
    assert any("eval_accuracy" in r for r in rows)

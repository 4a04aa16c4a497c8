"""Agent functions (`[agent] function`) for the endpoint tests: a raw `openai` client loop, an
OpenAI Agents SDK agent, a text-completions loop, and agents that fault in each counted way."""

import asyncio
import json
import os
import subprocess
import time
import zlib

from openai import AsyncOpenAI, AuthenticationError

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def openai_loop(base_url, api_key, model, row):
    """Model call -> tool -> model call with the `openai` client until the model answers."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        out = await client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL], logprobs=True)
        message = out.choices[0].message
        assert out.choices[0].logprobs.content, "the endpoint returns the generator's logprobs when asked"
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 1.0 if str(row["answer"]) in (message.content or "") else 0.0


async def agents_sdk(base_url, api_key, model, row):
    """The OpenAI Agents SDK: an `Agent` with a `function_tool`, `Runner.run` against base_url."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions="Use the add tool.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
    )
    result = await Runner.run(agent, row["prompt"], max_turns=4)
    return 1.0 if str(row["answer"]) in str(result.final_output) else 0.0


async def text_loop(base_url, api_key, model, row):
    """/v1/completions: the prompt grows by the model's text and a harness line each call; the
    reward is left to [reward] (None)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = row["prompt"]
    for _ in range(2):
        out = await client.completions.create(model=model, prompt=prompt)
        prompt += out.choices[0].text + "\nok\n"
    return None


async def faulty(base_url, api_key, model, row):
    """Faults by row['metadata']['mode'], each after one good call (or none)."""
    mode = row["metadata"]["mode"]
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    if mode == "wrong_key":
        try:
            await AsyncOpenAI(base_url=base_url, api_key="not-the-key", max_retries=0).models.list()
        except AuthenticationError:
            pass
        else:
            raise AssertionError("the endpoint served a wrong key")
    out = await client.chat.completions.create(model=model, messages=messages)
    messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "again"})
    if mode == "raises":
        raise RuntimeError("the agent broke")
    if mode == "hangs":
        await asyncio.sleep(3600)
    if mode == "blocks":  # a synchronous hang: its worker is replaced
        time.sleep(3600)
    if mode == "exits":
        os._exit(3)
    if mode == "unknown_model":
        await client.chat.completions.create(model="gpt-5", messages=messages)
    if mode == "bad_tool_json":
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{bad"}}
        messages[1] = {"role": "assistant", "content": None, "tool_calls": [call]}
        await client.chat.completions.create(model=model, messages=messages)
    if mode == "rewrite":
        messages[1]["content"] = "something the model did not say"
        await client.chat.completions.create(model=model, messages=messages)
    return 1.0


async def spawns_children(base_url, api_key, model, row):
    """Leaves a plain and a `setsid` sleep behind (their pids in $AGENT_PID_DIR), then waits."""
    folder = os.environ["AGENT_PID_DIR"]
    for argv in (["sleep", "300"], ["setsid", "sleep", "300"]):
        proc = subprocess.Popen(argv)
        with open(os.path.join(folder, str(proc.pid)), "w") as f:
            f.write(f"sleep {proc.pid}\n")
    await asyncio.sleep(3600)


_PLAYED: dict[str, int] = {}
"""Episodes played so far of each prompt, in this worker process."""


async def scripted_rewards(base_url, api_key, model, row):
    """One model call (chat, or text with metadata route = 'completions'), then the next of the
    row's metadata `rewards` for this prompt, in turn: with one worker, the k episodes of a prompt
    return each of its k rewards once, whatever order they run in. A row without `rewards` (a
    task's) returns None: [reward] scores it."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if row["metadata"].get("route") == "completions":
        await client.completions.create(model=model, prompt=row["prompt"])
    else:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    rewards = row["metadata"].get("rewards")
    if rewards is None:
        return None
    played = _PLAYED.get(row["prompt"], 0)
    _PLAYED[row["prompt"]] = played + 1
    return rewards[played % len(rewards)]


def half_correct(prompt, completion, metadata):
    """A transcript's score: 0.5, correct."""
    return {"reward": 0.5, "correct": True}


async def drops_thought(base_url, api_key, model, row):
    """A harness that rewrites history: the model's turn goes back without its thought (what
    precedes '</think>'; a turn without one is elided), then a user turn and a second call."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    out = await client.chat.completions.create(model=model, messages=messages)
    text = out.choices[0].message.content or ""
    kept = text.split("</think>", 1)[1].strip() if "</think>" in text else "[elided]"
    messages += [{"role": "assistant", "content": kept}, {"role": "user", "content": "Go on."}]
    await client.chat.completions.create(model=model, messages=messages)
    return 0.75


async def parity_reward(base_url, api_key, model, row):
    """One text completion; reward 1.0 for the even episodes (by the key's episode number) of a
    prompt whose CRC-32 is even, else 0.0: with group_size 2, groups of odd prompts are all 0."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.completions.create(model=model, prompt=row["prompt"])
    episode = int(api_key.rsplit("-", 1)[1])
    return float(zlib.crc32(row["prompt"].encode()) % 2 == 0 and episode % 2 == 0)

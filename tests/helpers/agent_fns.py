"""Agent functions (`[agent] function`) for the endpoint tests: a raw `openai` client loop, an
OpenAI Agents SDK agent, a text-completions loop, and agents that fault in each counted way."""

import asyncio
import json
import os
import subprocess
import time

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


async def smolagents_agent(base_url, api_key, model, row):
    """smolagents: a `ToolCallingAgent` with an `@tool` on an `OpenAIServerModel` against base_url,
    run in a thread (smolagents is synchronous). The endpoint serves no `stop` strings and no
    tool_choice 'required' (the policy samples freely), so the model drops both parameters. The
    turn budget's refusal ends the run (AgentGenerationError): the reward is then 0."""
    from smolagents import REMOVE_PARAMETER, AgentGenerationError, OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.monitoring import LogLevel

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b

    llm = OpenAIServerModel(
        model_id=model, api_base=base_url, api_key=api_key, client_kwargs={"max_retries": 0},
        stop=REMOVE_PARAMETER, tool_choice=REMOVE_PARAMETER,
    )  # fmt: skip
    agent = ToolCallingAgent(tools=[add], model=llm, max_steps=8, verbosity_level=LogLevel.OFF)
    agent.prompt_templates["system_prompt"] = "Use the add tool, then call final_answer."
    try:
        answer = await asyncio.to_thread(agent.run, row["prompt"])
    except AgentGenerationError:
        return 0.0
    return 1.0 if str(row["answer"]) in str(answer) else 0.0

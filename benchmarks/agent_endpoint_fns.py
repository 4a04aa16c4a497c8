"""The episodes of benchmarks/bench_agent_endpoint.py: the agent function (a raw `openai` loop)
and the in-process environment doing the same tool. A module of its own, without torch: the
agent and environment workers import it, and start quickly on a loaded machine."""

import json

from titanrl.envs.base import Environment
from titanrl.envs.tool_calls import ToolCall, tool_step

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "It is 5."


def add(a: int, b: int) -> int:
    """The tool: both sides run it on the model's call."""
    return a + b


_SHARED: dict = {}


def shared_http_client():
    """The agent worker's one connection pool (a worker runs its episodes on one event loop). An
    AsyncOpenAI client of its own builds an httpx client with an SSL context, some 50 ms of CPU
    per episode. No connection limit: every episode's call waits for the generator at once."""
    import httpx
    from openai import DefaultAsyncHttpxClient

    if "http" not in _SHARED:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        _SHARED["http"] = DefaultAsyncHttpxClient(timeout=600.0, limits=limits)
    return _SHARED["http"]


async def agent(base_url: str, api_key: str, model: str, row: dict) -> float:
    """A raw `openai` loop: model call with `tools`, the tool, model call with its result. With
    row['metadata']['client'] 'own' the episode's client has its own connection pool."""
    from openai import AsyncOpenAI

    own = row["metadata"]["client"] == "own"
    # A worker runs many episodes at once on one event loop: the client's default 5 s connect
    # timeout can pass before the loop gets to the connection.
    pool = {"timeout": 600.0} if own else {"http_client": shared_http_client()}
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, **pool)
    try:
        messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
        for _ in range(2):
            out = await client.chat.completions.create(model=model, messages=messages, tools=[ADD])
            message = out.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                result = str(add(**json.loads(call.function.arguments)))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if not message.tool_calls:
                break
    finally:
        if own:
            await client.close()
    return 1.0 if row["answer"] in (message.content or "") else 0.0


class AddEnv(Environment):
    """The same episode in-process: the first turn's `add` call answered, the next turn ends it."""

    tools = (ADD,)
    tool_formats = ("hermes",)

    def __init__(self, tool_format: str = "hermes") -> None:
        self.tool_format = tool_format

    def reset(self, sample: dict) -> str:
        self.answer = sample["answer"]
        return sample["prompt"]

    def step(self, model_text: str) -> tuple[str, float, bool, dict]:
        answered = tool_step(model_text, self.tool_format, self.tools, self.call)
        if answered is not None:
            return answered
        correct = self.answer in model_text
        return "", float(correct), True, {"correct": correct}

    def call(self, call: ToolCall) -> str:
        return str(add(**call.arguments))

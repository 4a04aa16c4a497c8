"""The agent of train_configs/grpo_smollm2_tool.toml: a raw `openai` client loop with one tool, a
calculator, as users write agents. It sends the row's chat (a system message that describes the
tool, then the word problem) with the tool's JSON schema, runs every tool call the model makes
(the endpoint parses the model's Hermes / Qwen `<tool_call>` JSON into OpenAI `tool_calls`) and
returns 1.0 when the final reply's last number is the product, else 0.0. The episodes of a
worker share one connection pool (docs/agents.md, "Many episodes per worker")."""

import json

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from titanrl.data.tasks import safe_arithmetic
from titanrl.data.word_problems import CALCULATOR, final_answer

MAX_CALLS = 3
_HTTP: httpx.AsyncClient | None = None


def calculate(arguments: str) -> str:
    """The calculator: the value of the call's expression, or an error message the model reads."""
    try:
        value, _ = safe_arithmetic(str(json.loads(arguments)["expression"]))
    except (ValueError, SyntaxError, RecursionError, KeyError, TypeError, ZeroDivisionError):
        return "error: give an expression of integers with + - * / and parentheses"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def http_client() -> httpx.AsyncClient:
    """This worker's connection pool: no connection limit (every episode waits on the generator
    at once), a timeout past the longest wait."""
    global _HTTP
    if _HTTP is None:
        _HTTP = DefaultAsyncHttpxClient(timeout=600.0, limits=httpx.Limits(max_connections=None))
    return _HTTP


async def run(base_url: str, api_key: str, model: str, row: dict) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client())
    messages = list(row["metadata"]["messages"])
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    content = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    return 1.0 if final_answer(content or "") == str(row["answer"]) else 0.0

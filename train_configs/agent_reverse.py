"""A minimal agent for `[agent] function` (train_configs/grpo_agent_debug.toml): one text
completion through the OpenAI API of the rank's endpoint, left to [reward] to score (None).
With a chat model, call `client.chat.completions.create(..., tools=[...])` in a loop instead
(docs/agents.md)."""

from openai import AsyncOpenAI


async def run(base_url: str, api_key: str, model: str, row: dict) -> float | None:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.completions.create(model=model, prompt=row["prompt"])
    return None  # the task's verifier scores the transcript

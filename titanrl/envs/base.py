"""The multi-turn environment interface and the tool-call format.

An environment is stateful per episode and runs in a worker process (`titanrl/envs/pool.py`):

    env = MyEnv(**kwargs)
    first_observation = env.reset(sample)          # sample: {"prompt", "answer", "metadata"}
    observation, reward, done, info = env.step(model_text)

`model_text` is what the model wrote in its turn (the turn ends on eos, on one of the env's
`stop_strings`, or at the per-turn token limit); `observation` is appended to the conversation
and is masked out of the loss. Rewards of all turns are summed into the episode's reward.

Tool calls use a tag format by default, `<tool>...</tool>` answered by `<result>...</result>`;
`parse_tool_call` reads it and `parse_json_call` reads a JSON function call inside it,
`{"name": ..., "arguments": {...}}`. The formats chat templates define (Qwen / Hermes
`<tool_call>` tags, Llama 3 JSON calls) are read by `titanrl/envs/tool_calls.py`: an environment
that reads them lists them in `tool_formats`, declares its tools' JSON schemas in `tools` (passed
to the chat template as HF's `apply_chat_template(tools=...)` does) and is built with
`tool_format=` the configured one (env.tool_format) when that is not 'tag'.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class Environment:
    """Base class (subclass it, or duck-type `reset` / `step`)."""

    stop_strings: tuple[str, ...] = (TOOL_CLOSE,)
    """Strings that end a model turn (besides eos) and hand control to the environment (with the
    'tag' tool format; in a chat template's format the turn ends at the template's end of turn)."""

    tools: tuple[dict, ...] = ()
    """JSON schemas of the environment's tools ({"type": "function", "function": {"name", "description",
    "parameters"}}), rendered into the prompt by chat templates that describe tools."""

    tool_formats: tuple[str, ...] = ("tag",)
    """The tool-call formats the environment reads (see titanrl/envs/tool_calls.py); one other than
    'tag' is passed to its constructor as `tool_format=`."""

    def reset(self, sample: dict[str, Any]) -> str:
        raise NotImplementedError

    def step(self, model_text: str) -> tuple[str, float, bool, dict]:
        raise NotImplementedError


def parse_tool_call(text: str, open_tag: str = TOOL_OPEN, close_tag: str = TOOL_CLOSE) -> str | None:
    """The content of the last complete `open_tag ... close_tag` in `text`, or None."""
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    return None if start < 0 else text[start + len(open_tag) : end]


def parse_json_call(content: str) -> tuple[str, dict] | None:
    """(name, arguments) of a JSON function call `{"name": str, "arguments": {...}}`, or None
    if `content` is not one (malformed JSON, wrong types)."""
    try:
        call = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (call["name"], args) if isinstance(args, dict) else None


_INT = re.compile(r"-?\d+")


def last_int(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None

"""Tool calls in the model's own format: the formats chat templates define, parsed from a turn.

`parse_tool_calls(text, tool_format, tool_names)` reads every call of one model turn:

- 'hermes' (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several per turn, text around them allowed.
- 'llama3' (Llama 3.1 / 3.2 JSON tool calls): the turn is `{"name": ..., "parameters": {...}}`
  (or "arguments"), optionally after `<|python_tag|>` (text before the tag is the model's prose);
  several calls are separated by ';' or whitespace. A turn that does not start with '{' (and has
  no `<|python_tag|>`) has no call.
- 'tag' (titanrl's own): `<tool>...</tool>`, several per turn; the content is a JSON call as above
  or free text, which is a call of the environment's only tool (`ToolCall.name` None).

'auto' picks hermes or llama3 from the chat template's text (`resolve_tool_format`).

A malformed call (bad JSON, no name, arguments that are not an object, a tag left open because
the turn was cut off at its token limit, an unknown tool) raises `ToolCallError`, whose message
is written for the model: environments answer it as an error observation and the episode goes
on. The text parsed is the decoding of the turn's generated tokens; the tokens themselves stay in
the sample as generated (`titanrl/envs/multi_turn.py`), never re-encoded from this text.
"""

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from titanrl.config.rewards_envs import TOOL_FORMATS
from titanrl.envs.base import RESULT_CLOSE, RESULT_OPEN, TOOL_CLOSE, TOOL_OPEN

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"[\s;]*")


class ToolCallError(ValueError):
    """A malformed tool call; its message is the error observation the model sees."""


@dataclass
class ToolCall:
    name: str | None
    """The tool's name; None for a free-text call of the tag format (the env's only tool)."""
    arguments: dict = field(default_factory=dict)
    text: str = ""
    """The call as the model wrote it (between its tags)."""


def tool_name(tool: dict) -> str:
    """The name of a tool given as an OpenAI / HF JSON schema ({"type": "function", "function":
    {"name": ...}}) or as a bare function schema ({"name": ...})."""
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool schema needs a 'name' (or 'function.name'), got {tool!r}")
    return name


def json_call(content: str, index: int, args_keys: Sequence[str] = ("arguments",)) -> ToolCall:
    """The call `{"name": str, <args key>: {...} | "<json object>"}` of `content`."""
    try:
        call = json.loads(content)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call {index}: invalid JSON ({e.msg} at character {e.pos})") from None
    return checked_call(call, content, index, args_keys)


def checked_call(call: object, content: str, index: int, args_keys: Sequence[str]) -> ToolCall:
    """`call` (decoded JSON) as a ToolCall: a non-empty string name, arguments an object."""
    if not isinstance(call, dict):
        raise ToolCallError(f"tool call {index}: expected a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError(f'tool call {index}: missing "name" (a non-empty string)')
    key = next((k for k in args_keys if k in call), None)
    args = call.get(key, {}) if key else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ToolCallError(f'tool call {index}: "{key}" is a string that is not a JSON object') from None
    if not isinstance(args, dict):
        keys = " or ".join(f'"{k}"' for k in args_keys)
        raise ToolCallError(f"tool call {index}: {keys} must be a JSON object, got {type(args).__name__}")
    return ToolCall(name.strip(), args, content)


def tagged(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The contents of every `open_tag ... close_tag` of `text`, in order; a tag left open (the
    turn cut off) or a stray close tag is a ToolCallError."""
    contents: list[str] = []
    pos = 0
    while True:
        start, stray = text.find(open_tag, pos), text.find(close_tag, pos)
        if start < 0 and stray < 0:
            return contents
        if start < 0 or 0 <= stray < start:
            raise ToolCallError(f"{close_tag} without an opening {open_tag}")
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            raise ToolCallError(
                f"{open_tag} without {close_tag}: the tool call is incomplete (cut off at the turn's token limit?)"
            )
        inner = text[start + len(open_tag) : end]
        if open_tag in inner:
            raise ToolCallError(f"{open_tag} opened again before {close_tag}")
        contents.append(inner)
        pos = end + len(close_tag)


def parse_hermes(text: str) -> list[ToolCall]:
    return [json_call(c.strip(), i + 1) for i, c in enumerate(tagged(text, HERMES_OPEN, HERMES_CLOSE))]


def parse_tag(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for i, content in enumerate(tagged(text, TOOL_OPEN, TOOL_CLOSE)):
        if content.strip().startswith("{"):
            calls.append(json_call(content.strip(), i + 1))
        else:
            calls.append(ToolCall(None, {}, content))
    return calls


def _separator_end(text: str, pos: int) -> int:
    match = _SEPARATOR.match(text, pos)
    assert match is not None, "the separator pattern matches the empty string"
    return match.end()


def parse_llama3(text: str) -> list[ToolCall]:
    tag = text.find(PYTHON_TAG)
    body = text[tag + len(PYTHON_TAG) :] if tag >= 0 else text
    if tag < 0 and not body.lstrip().startswith("{"):
        return []
    decoder, pos = json.JSONDecoder(), _separator_end(body, 0)
    calls: list[ToolCall] = []
    while pos < len(body):
        index = len(calls) + 1
        if body[pos] != "{":
            raise ToolCallError(f"tool call {index}: expected a JSON object, found {body[pos : pos + 20]!r}")
        try:
            call, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            cut = " (the call is incomplete: cut off at the turn's token limit?)" if unclosed(body[pos:]) else ""
            raise ToolCallError(f"tool call {index}: invalid JSON ({e.msg}){cut}") from None
        calls.append(checked_call(call, body[pos:end], index, ("parameters", "arguments")))
        pos = _separator_end(body, end)
    if not calls:
        raise ToolCallError(f"{PYTHON_TAG} without a tool call after it")
    return calls


def unclosed(text: str) -> bool:
    """Whether JSON `text` ends inside a string or with an object or array left open."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_string or depth > 0


_PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": parse_hermes,
    "llama3": parse_llama3,
    "tag": parse_tag,
}


def parse_tool_calls(text: str, tool_format: str, tool_names: Sequence[str] | None = None) -> list[ToolCall]:
    """Every tool call of a model turn in `tool_format` ('hermes', 'llama3', 'tag'); [] if it has
    none (a final answer). ToolCallError: a malformed call, or a name not in `tool_names`."""
    if tool_format not in _PARSERS:
        raise ValueError(f"tool_format must be one of {sorted(_PARSERS)} here, got {tool_format!r}")
    calls = _PARSERS[tool_format](text)
    if tool_names is not None:
        for i, call in enumerate(calls):
            if call.name is not None and call.name not in tool_names:
                known = ", ".join(tool_names) or "none"
                raise ToolCallError(f"tool call {i + 1}: unknown tool {call.name!r} (available: {known})")
    return calls


def detect_tool_format(template_text: str) -> str | None:
    """'hermes' for a template that writes <tool_call> tags, 'llama3' for Llama 3's ipython tool
    role / <|python_tag|>, else None."""
    if HERMES_OPEN in template_text:
        return "hermes"
    if PYTHON_TAG in template_text or "ipython" in template_text:
        return "llama3"
    return None


def resolve_tool_format(tool_format: str, templates: Sequence[str] | None) -> str:
    """`tool_format` with 'auto' replaced by the format of the chat template(s) `templates` ('tag'
    without a template)."""
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"[env] tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    if tool_format != "auto":
        return tool_format
    if not templates:
        return "tag"
    found = detect_tool_format("\n".join(templates))
    if found is None:
        raise ValueError(
            "[env] tool_format 'auto': the chat template writes neither <tool_call> tags (hermes) nor "
            "Llama 3's ipython tool role (llama3); set env.tool_format to 'hermes', 'llama3' or 'tag'"
        )
    return found


def format_results(results: Sequence[str], tool_format: str) -> str:
    """Tool results as raw text (the observation when there is no chat template to render them
    as 'tool' messages): <tool_response> blocks (hermes), <result> tags (tag), one per line (llama3)."""
    if tool_format == "hermes":
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
    if tool_format == "tag":
        return "".join(f"{RESULT_OPEN}{r}{RESULT_CLOSE}" for r in results)
    return "\n".join(results)


def tool_step(
    text: str, tool_format: str, tools: Sequence[dict], run: Callable[[ToolCall], str]
) -> tuple[str, float, bool, dict] | None:
    """An environment's step for a turn with tool calls: each call's result (`run(call)`), or one
    'error: ...' result for a malformed turn, as (observation, 0.0, False, info); None when the
    turn has no call (a final answer). `info['tool_results']` holds the results one by one, which
    a chat template renders as one 'tool' message each; the observation is their raw text."""
    try:
        calls = parse_tool_calls(text, tool_format, [tool_name(t) for t in tools])
    except ToolCallError as e:
        results = [f"error: {e}"]
        info = {"tool_call": True, "tool_error": True, "tool_results": results}
        return format_results(results, tool_format), 0.0, False, info
    if not calls:
        return None
    results = [run(call) for call in calls]
    return format_results(results, tool_format), 0.0, False, {"tool_call": True, "tool_results": results}

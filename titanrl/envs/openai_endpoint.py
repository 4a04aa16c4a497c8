"""The OpenAI-compatible HTTP side of `AgentPool`: request checks, replies, and the ASGI app.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, each behind
`Authorization: Bearer <key>`, where every episode has its own key (the run's secret and the
episode's number), so each call is tied to its sample. What a request may ask is what the
policy's sampling is: `n` 1, `temperature` / `top_p` the generator's (the trained logprobs are
at those), `max_tokens` / `max_completion_tokens` at least generator.max_new_tokens (the turn
never exceeds the smaller), no `stop` strings, no streaming, `tool_choice` 'auto' or 'none';
anything else is an HTTP 400 naming the parameter and the value the endpoint serves.
`logprobs` gives the generator's own logprobs of the sampled tokens.
"""

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from titanrl.envs.tool_calls import ToolCall, tool_name

ROLES = ("system", "developer", "user", "assistant", "tool")


class EndpointError(Exception):
    """A refused request: its HTTP status, OpenAI error code and message; `reason`, when set, fails
    the episode with that counted reason."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", reason: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.reason = status, message, code, reason

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.code, "code": self.code}}


@dataclass
class Served:
    """What the endpoint serves: the model's name and the generator's sampling."""

    model: str
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass
class Request:
    route: str
    """'chat' or 'completions'."""
    messages: list[dict] = field(default_factory=list)
    """chat: the conversation, normalised (roles, text content, checked tool calls)."""
    tools: list[dict] | None = None
    prompt: str | list[int] = ""
    """completions: the prompt, text or token ids."""
    parse_tools: bool = True
    """chat: whether the model's tool calls are returned as `tool_calls` (tool_choice != 'none')."""
    logprobs: bool = False


def _text(content: Any, where: str) -> str:
    """A message's content as text: a str, None, or a list of {'type': 'text', 'text': ...} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise EndpointError(400, f"{where}: content must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked: ids, names, arguments that are JSON objects."""
    if not isinstance(calls, list):
        raise EndpointError(400, f"{where}: tool_calls must be a list", reason="invalid: malformed tool JSON")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(parsed, dict):
            raise EndpointError(
                400,
                f"{where}: tool_calls[{i}] must be {{'id', 'function': {{'name': str, 'arguments': a JSON object "
                "as a string}}}}",
                reason=f"invalid: malformed tool JSON in {where}",
            )
        out.append(
            {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": parsed}}
        )
    return out


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise EndpointError(400, "messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise EndpointError(400, f"{where}: role must be one of {ROLES}")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            message["tool_call_id"] = str(m.get("tool_call_id", ""))
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    try:
        if not isinstance(raw, list):
            raise ValueError("tools must be a list")
        for tool in raw:
            if not isinstance(tool, dict):
                raise ValueError(f"a tool must be a JSON object, got {tool!r}")
            tool_name(tool)
            params = tool.get("function", tool).get("parameters", {})
            if not isinstance(params, dict):
                raise ValueError(f"a tool's parameters must be a JSON schema object, got {params!r}")
    except ValueError as e:
        raise EndpointError(400, f"tools: {e}", reason="invalid: malformed tool JSON in tools") from None
    return raw


def _check_sampling(body: dict, served: Served) -> None:
    """400 for what the generator does not sample as asked (see the module docstring)."""
    problems = []
    for name, value in (("temperature", served.temperature), ("top_p", served.top_p)):
        asked = body.get(name)
        if asked is not None and not (isinstance(asked, (int, float)) and math.isclose(asked, value, abs_tol=1e-6)):
            problems.append(f"{name} {asked!r} (the policy samples at [generator] {name} = {value:g})")
    for name in ("max_tokens", "max_completion_tokens"):
        asked = body.get(name)
        if asked is not None and not (isinstance(asked, int) and asked >= served.max_new_tokens):
            problems.append(f"{name} {asked!r} (a turn is generator.max_new_tokens = {served.max_new_tokens})")
    if body.get("n") not in (None, 1):
        problems.append(f"n {body['n']!r} (one choice per call: the group's samples are separate episodes)")
    if body.get("stop") not in (None, "", []):
        problems.append(f"stop {body['stop']!r} (a turn ends at the model's end of turn)")
    if body.get("stream"):
        problems.append("stream true (replies are whole)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        problems.append(f"tool_choice {body['tool_choice']!r} ('auto' or 'none')")
    if body.get("top_logprobs") not in (None, 0):
        problems.append(f"top_logprobs {body['top_logprobs']!r} (the sampled token's logprob only)")
    if body.get("response_format") not in (None, {"type": "text"}):
        problems.append("response_format (free text only)")
    if problems:
        raise EndpointError(400, "unsupported by the titanrl endpoint: " + "; ".join(problems))


def parse_request(route: str, body: Any, served: Served) -> Request:
    """The request `body` of `route` ('chat' or 'completions'), checked; EndpointError if refused."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != served.model:
        raise EndpointError(
            404, f"model {model!r} does not exist; this endpoint serves {served.model!r}", "model_not_found",
            reason=f"unknown_model: {str(model)[:100]}",
        )  # fmt: skip
    _check_sampling(body, served)
    logprobs = bool(body.get("logprobs"))
    if route == "chat":
        messages, tools = _messages(body.get("messages")), _tools(body.get("tools"))
        return Request("chat", messages, tools, parse_tools=body.get("tool_choice") != "none", logprobs=logprobs)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return Request("completions", prompt=prompt, logprobs=logprobs)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Request("completions", prompt=[int(t) for t in prompt], logprobs=logprobs)
    raise EndpointError(400, "prompt must be a non-empty string or a list of token ids (one prompt)")


def _logprobs(tokens: list[str], logprobs: list[float], chat: bool) -> dict:
    if chat:
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs)
        ]
        return {"content": content}
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def reply(
    request: Request,
    model: str,
    text: str,
    calls: list[ToolCall],
    content: str | None,
    finish: str,
    usage: tuple[int, int],
    logprobs: tuple[list[str], list[float]] | None,
) -> dict:
    """The OpenAI reply for one model turn: a chat completion (`content`, `calls` as tool_calls)
    or a text completion (`text`)."""
    common = {"id": f"titanrl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    common["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    lp = _logprobs(*logprobs, request.route == "chat") if logprobs is not None else None
    if request.route != "chat":
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
        return {**common, "object": "text_completion", "choices": [choice]}
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
             "function": {"name": c.name or "", "arguments": json.dumps(c.arguments)}}
            for c in calls
        ]  # fmt: skip
        finish = "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}
    return {**common, "object": "chat.completion", "choices": [choice]}


def build_app(handle: Any, models: Any) -> Any:
    """The ASGI app: `handle(route, key, body)` (a coroutine) answers a completion route with
    (status, JSON body); `models(key)` answers GET /v1/models the same way."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    def key_of(request: HTTPRequest) -> str:
        auth = request.headers.get("authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""

    async def complete(route: str, request: HTTPRequest) -> JSONResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        status, out = await handle(route, key_of(request), body)
        return JSONResponse(out, status_code=status)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest) -> JSONResponse:
        return await complete("chat", request)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> JSONResponse:
        return await complete("completions", request)

    @app.get("/v1/models")
    async def list_models(request: HTTPRequest) -> JSONResponse:
        status, out = models(key_of(request))
        return JSONResponse(out, status_code=status)

    return app

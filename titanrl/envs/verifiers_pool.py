"""Episodes of `verifiers` environments (`verifiers.v1`), with `EnvPool`'s interface (reset /
step / close_episode / poll -> EnvResult), so `MultiTurnRollout` drives them unchanged.

A verifiers environment has no reset/step: a taskset's task is played by a harness, an agent
program that calls the model through an OpenAI-compatible endpoint (verifiers' interception
server on 127.0.0.1, which records the turns in the rollout's trace), and the task's rewards,
judges and rubrics score the trace when the program ends. Here control is inverted: `reset`
starts the rollout (`verifiers.v1.Agent.run`) in a background event-loop thread, with the
interception server's model client replaced by an in-process one (`_PolicyClient`): a model
request of the harness is held and handed to the trainer as an observation, and `step` answers
it with the model's turn. So:

- the harness's first request -> the first observation: the text of its messages (a system
  message's, then the user's, as verifiers folds a system prompt into the prompt); the tools it
  declares (`episode_tools`) go to the chat template as `tools`;
- `step(text)` answers the request (an assistant message; with `tool_format` 'hermes' or
  'llama3' its tool calls become OpenAI `tool_calls`, which the harness runs) and waits for the
  next request -> the messages added since (its user or tool messages; tool results as
  `info['tool_results']`), or for the rollout's end -> done, the reward verifiers scored.

Failures are named and counted as an in-process environment's: a harness or a scoring hook that
raises -> 'error: <verifiers error>'; no request and no end within `timeout_s` -> 'timeout' (the
rollout is cancelled); a harness that rewrites the conversation it was given (the trained tokens
must be what the model saw) or calls a non-chat-completions route -> 'invalid: ...'. A rollout is
never retried: a retry would restart a conversation whose turns are already in the sample.
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from titanrl.components.plugins import load_object
from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.pool import EnvResult, validate_step
from titanrl.envs.tool_calls import ToolCallError, parse_tool_calls


def require_verifiers() -> None:
    """One line naming the package when `[env] verifiers` is set without it."""
    try:
        import verifiers.v1  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"[env] verifiers needs the `verifiers` package (>= 0.4, `verifiers.v1`): "
            f"pip install 'titanrl[verifiers]' ({e})"
        ) from None


def load_setup(spec: str) -> tuple[Any, Any]:
    """(taskset, resolved AgentConfig) of `[env] verifiers`: a taskset id (an installed package
    exporting a `vf.Taskset`, and its `vf.Harness` if it has one), run by its default harness in
    the local subprocess runtime; or 'module:factory' returning a `vf.SingleAgentEnvConfig`."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.env import default_agent_harness
    from verifiers.v1.utils.loaders import load_taskset

    if ":" in spec:
        config = load_object(spec, "[env] verifiers")()
        if not isinstance(config, vf.SingleAgentEnvConfig):
            raise ValueError(
                f"[env] verifiers = {spec!r}: the factory returned {type(config).__name__}, not a "
                "verifiers.v1.SingleAgentEnvConfig (one agent seat over a taskset)"
            )
    else:
        try:
            config = vf.SingleAgentEnvConfig(
                taskset=vf.TasksetConfig(id=spec), agent=vf.AgentConfig(runtime=vf.SubprocessConfig())
            )
            taskset = load_taskset(config.taskset)
        except (ImportError, TypeError, AttributeError) as e:
            raise ValueError(
                f"[env] verifiers = {spec!r} is not an installed verifiers taskset ({e}); give a taskset "
                "package's id or a 'module:factory' returning a verifiers.v1.SingleAgentEnvConfig"
            ) from None
    if ":" in spec:
        taskset = load_taskset(config.taskset)
    agent = config.agent
    update = {"harness": agent.harness or default_agent_harness(config.taskset.id), "retries": vf.RetryConfig()}
    return taskset, agent.model_copy(update={**update, "model": agent.model or "titanrl-policy"})


def make_task(taskset: Any, sample: dict) -> Any:
    """The taskset's task for a titanrl sample: its `prompt` and `answer` (where the task's data
    has such fields), updated with `sample['metadata']['verifiers_task']` (more data fields)."""
    task_cls = type(taskset).task_type()
    data_cls = task_cls.data_type()
    data = {k: sample[k] for k in ("prompt", "answer") if k in data_cls.model_fields and k in sample}
    data.update((sample.get("metadata") or {}).get("verifiers_task") or {})
    return task_cls(data_cls.model_validate(data), taskset.config.task)


def completion(text: str, model: str, tool_format: str, has_tools: bool) -> dict:
    """The model's turn as an OpenAI chat completion (what the harness's SDK reads)."""
    message: dict = {"role": "assistant", "content": text}
    finish = "stop"
    if has_tools and tool_format in ("hermes", "llama3"):
        try:
            calls = parse_tool_calls(text, tool_format)
        except ToolCallError:
            calls = []  # a malformed call stays text: the harness answers it as a plain reply
        if calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "type": "function",
                    "function": {"name": c.name or "", "arguments": json.dumps(c.arguments)},
                }
                for c in calls
            ]
            finish = "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": finish}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"id": f"titanrl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage}  # fmt: skip


@dataclass
class _Episode:
    events: asyncio.Queue
    """('request', messages, reply future), ('end', trace, None) or ('raised', exception, None)."""
    run: asyncio.Task | None = None
    pending: asyncio.Future | None = None
    """The harness's request waiting for the model's turn."""
    replies: list[str] = field(default_factory=list)
    tools: list[dict] | None = None
    """The tools (OpenAI JSON schemas) of the harness's first request, for the chat template."""
    seen: int = 0
    """Messages of the harness's conversation already given to the trainer."""


def _policy_client(pool: "VerifiersEnvPool") -> Any:
    """An in-process `verifiers.v1.Client`: the harness's model request waits for the trainer."""
    from verifiers.v1.clients import Client
    from verifiers.v1.errors import model_error

    class PolicyClient(Client):
        async def get_response(  # verifiers' signature: (dialect, body, sampling, session_id, turn, headers)
            self,
            dialect: Any,
            body: dict,
            sampling: Any,
            session_id: str | None = None,
            turn: Any = None,
            headers: Any = None,
        ) -> Any:
            episode = pool.by_trace.get(session_id or "")
            if episode is None:
                raise model_error("no titanrl episode holds this rollout", status_code=409)
            if dialect.upstream_path != "/chat/completions":
                await episode.events.put(
                    ("raised", ValueError(f"invalid: the harness calls {dialect.upstream_path}"), None)
                )
                raise model_error("titanrl serves chat completions only", status_code=400)
            request = dialect.parse_request(body)
            if not episode.replies and isinstance(body.get("tools"), list):
                episode.tools = body["tools"] or None
            reply = asyncio.get_running_loop().create_future()
            await episode.events.put(("request", request, reply))
            raw = completion(await reply, str(body.get("model", "")), pool.tool_format, bool(request.tools))
            response = dialect.parse_response(dialect.validate_response(raw))
            response.raw = raw
            return response

    return PolicyClient()


def _text(message: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(message.content)


def _error_reason(trace: Any) -> str:
    error = trace.errors[-1]
    return f"error: verifiers rollout: {error.type}: {error.message}"[:500]


class VerifiersEnvPool(AsyncEnvPool):
    def __init__(self, spec: str, timeout_s: float = 10.0, tool_format: str = "tag") -> None:
        """`spec`: `[env] verifiers` (see `load_setup`); `timeout_s`: the longest the harness may
        take to ask the model again or to end (scoring included)."""
        require_verifiers()
        from verifiers.v1.interception.server import InterceptionServer

        self.taskset, self.agent_config = load_setup(spec)
        self.timeout_s, self.tool_format = timeout_s, tool_format
        self.by_trace: dict[str, _Episode] = {}
        """Rollouts (verifiers trace id) -> their episode (touched only on the loop thread)."""
        self._episodes: dict[int, _Episode] = {}
        self.poll_backstop_s = timeout_s + 60.0
        client = _policy_client(self)

        class Server(InterceptionServer):
            def _client(self, config: Any) -> Any:  # every rollout's model is the trainer's policy
                return client

        self.server = Server()
        super().__init__("verifiers-env")
        asyncio.run_coroutine_threadsafe(self.server.__aenter__(), self._loop).result(timeout=60.0)

    def episode_tools(self, eid: int) -> list[dict] | None:
        """The tools the harness declared in episode `eid`'s first request (after its reset)."""
        episode = self._episodes.get(eid)
        return episode.tools if episode is not None else None

    def close(self) -> None:
        """Cancel every rollout, stop the interception server and the loop thread."""
        self._stop_loop(close_timeout_s=30.0)

    # ---- the loop thread ----

    async def _rollout(self, episode: _Episode, task: Any) -> None:
        import verifiers.v1 as vf

        def minted(trace: Any) -> None:
            self.by_trace[trace.id] = episode

        try:
            async with vf.Agent(self.agent_config, interception=self.server) as agent:
                trace = await agent.run(task, on_trace=minted)
        except Exception as e:  # noqa: BLE001 - the episode fails, the run goes on
            await episode.events.put(("raised", e, None))
            return
        await episode.events.put(("end", trace, None))

    async def _reset(self, eid: int, sample: dict) -> None:
        try:
            task = make_task(self.taskset, sample)
        except Exception as e:  # noqa: BLE001 - a sample the task's data rejects fails its episode
            self._results.put(EnvResult(eid, "reset", None, f"invalid: the verifiers task rejects the sample: {e}"))
            return
        episode = self._episodes[eid] = _Episode(asyncio.Queue())
        episode.run = asyncio.create_task(self._rollout(episode, task))
        value = await self._next(eid, episode)
        if isinstance(value, tuple):
            self._results.put(EnvResult(eid, "reset", value[0]))
        elif value is not None:
            await self._close(eid)
            self._results.put(
                EnvResult(eid, "reset", None, "invalid: the verifiers rollout ended before asking the model")
            )

    async def _step(self, eid: int, text: str) -> None:
        episode = self._episodes.get(eid)
        if episode is None or episode.pending is None:
            self._results.put(EnvResult(eid, "step", None, "crash: the episode's rollout is gone"))
            return
        episode.pending.set_result(text)
        episode.pending = None
        episode.replies.append(text)
        value = await self._next(eid, episode)
        if isinstance(value, tuple):
            value = validate_step((value[0], 0.0, False, value[1]))
        if value is not None:
            self._results.put(EnvResult(eid, "step", value))

    async def _next(self, eid: int, episode: _Episode) -> Any:
        """The next observation (text, info), the end (a StepResult), or None after putting a failure."""
        try:
            kind, value, reply = await asyncio.wait_for(episode.events.get(), self.timeout_s)
            if kind == "raised":
                raise value
            if kind == "end":
                if value.errors:
                    raise RuntimeError(_error_reason(value))
                reward = float(value.reward)
                rewards = {k: (r.score if r is not None else None) for k, r in value.rewards.items()}
                return validate_step(("", reward, True, {"correct": reward > 0, "verifiers_rewards": rewards}))
            episode.pending = reply
            return self._observation(episode, value.messages)
        except Exception as e:  # noqa: BLE001 - named and counted, never raised
            await self._close(eid)
            self._results.put(EnvResult(eid, "reset" if not episode.replies else "step", None, _reason(e)))
            return None

    def _observation(self, episode: _Episode, messages: list) -> tuple[str, dict]:
        """The messages added since the model's last turn, checked against what it said."""
        said = [_text(m) for m in messages if m.role == "assistant"]
        if said != episode.replies:
            raise ValueError("invalid: the harness rewrote the conversation (its assistant turns are not the model's)")
        new = messages[episode.seen :]
        if episode.replies:
            new = new[1:]  # the model's own last turn
        episode.seen = len(messages)
        info = {"tool_results": [_text(m) for m in new]} if new and all(m.role == "tool" for m in new) else {}
        return "\n\n".join(_text(m) for m in new), info

    async def _close(self, eid: int) -> None:
        episode = self._episodes.pop(eid, None)
        if episode is None:
            return
        if episode.pending is not None and not episode.pending.done():
            episode.pending.cancel()
        if episode.run is not None and not episode.run.done():
            episode.run.cancel()
            await asyncio.wait([episode.run], timeout=10.0)
        for trace_id in [t for t, e in self.by_trace.items() if e is episode]:
            del self.by_trace[trace_id]

    async def _close_all(self) -> None:
        for eid in list(self._episodes):
            await self._close(eid)
        await self.server.__aexit__(None, None, None)


def _reason(e: BaseException) -> str:
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    message = str(e)
    if message.startswith(("invalid: ", "error: ")):
        return message[:500]
    return f"error: {type(e).__name__}: {e}"[:500]

"""Agent episodes (`[agent] function`) against an OpenAI-compatible endpoint over the generator.

`AgentPool` runs, on its event-loop thread (`AsyncEnvPool`'s), an HTTP server on 127.0.0.1 (a
free port; `openai_endpoint.py`) and the trainer's side of the agent workers (`agent_worker.py`,
contained as environment workers are: whatever an agent starts dies with its worker, and every
worker dies with the rank). An episode is one call of the user's agent in a worker, given the
endpoint's URL, the episode's own key and the model's name; each model call the agent makes is
an event that the trainer's `AgentRollout` (`agent_rollout.py`) turns into the sample's next
turn, and answers with the model's turn (`step`) or a refusal (`refuse`). So a call parks its
agent until the generator has decoded the turn, batched with every other sample.

Faults end only their episode, with a counted reason (the first word): 'error: ...' (the agent
raised, or returned what is not a reward), 'timeout' (past [agent] timeout_s; the agent is
cancelled, and its worker replaced if it does not let go), 'crash: ...' (its worker exited),
'unknown_model: ...', 'invalid: ...' (malformed tool JSON, concurrent calls of one episode).
A request without a valid key is refused (401) and counted in `refused`.
"""

import asyncio
import itertools
import json
import queue
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from titanrl.components.containment import announce
from titanrl.components.plugins import find_file
from titanrl.config.agent import Agent
from titanrl.envs.agent_workers import AgentWorker, AgentWorkers
from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.openai_endpoint import EndpointError, Served, build_app, parse_request

_CANCEL_GRACE_S = 3.0
"""How long a cancelled agent may take to let go before its worker is replaced."""
_KEEP_ALIVE_S = 75
"""How long the endpoint keeps an idle HTTP connection open."""


@dataclass
class AgentEvent:
    """What the trainer hears of an episode: its agent's next model call, or its end."""

    episode: int
    kind: str
    """'request' (value: the `Request`), 'end' (value: the reward, or None) or 'fail' (error)."""
    value: Any = None
    error: str | None = None


@dataclass
class _Episode:
    eid: int
    key: str
    worker: AgentWorker
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: asyncio.Future | None = None
    """The agent's model call waiting for its reply (a dict, or an EndpointError)."""
    running: bool = True
    """The agent has not returned yet."""
    failed: str | None = None
    over: bool = False
    """The sample ended (refused call): later calls are refused at once."""
    cancelled_at: float | None = None

    def answer(self, answer: dict | EndpointError) -> None:
        """Reply to the pending call (if any) with `answer`."""
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(answer)
        self.pending = None

    def cancel(self) -> None:
        """Have the worker cancel the agent (once)."""
        if self.running and self.cancelled_at is None:
            self.cancelled_at = time.monotonic()
            self.worker.send(("cancel", self.eid))


class AgentPool(AsyncEnvPool):
    def __init__(self, agent: Agent, served: Served, startup_timeout_s: float = 60.0) -> None:
        self.agent, self.served = agent, served
        self.secret = secrets.token_hex(16)
        """The run's secret: an episode's key is it and the episode's number."""
        self.refused = 0
        """Requests refused for a missing or wrong key (touched on the loop thread)."""
        self.episode_ids = itertools.count()
        """Numbers for new episodes (the trainer's thread): no two episodes of the pool share one."""
        self._events: queue.SimpleQueue[AgentEvent] = queue.SimpleQueue()
        self._episodes: dict[int, _Episode] = {}
        self._by_key: dict[str, int] = {}
        module, _, name = agent.function.rpartition(":")
        spec = f"{find_file(module, '[agent] function')}:{name}" if module.endswith(".py") else agent.function
        init = {"spec": spec, "memory_limit_mb": agent.memory_limit_mb, "sys_path": list(sys.path)}
        announce("agent")
        self.workers = AgentWorkers(init, agent.num_workers, startup_timeout_s)
        super().__init__("agent-endpoint")
        self.poll_backstop_s = agent.timeout_s + 2 * _CANCEL_GRACE_S + 30.0
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    # ---- the trainer's thread ----

    def refuse(self, eid: int, error: EndpointError) -> None:
        """Answer the episode's pending call with `error` and end its sample; the next event is
        its agent's end (or failure)."""
        self.step(eid, json.dumps({"refused": [error.status, error.message, error.code]}))

    def events(self, block: bool) -> list[AgentEvent]:
        """Events of the calls submitted (`reset`, `step`, `refuse`); with `block`, at least one."""
        out: list[AgentEvent] = []
        if block and self._in_flight:
            out.append(self._events.get(timeout=self.poll_backstop_s))
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def close(self) -> None:
        """Cancel every episode, stop the server, the loop thread and the workers."""
        self._stop_loop(close_timeout_s=10.0)
        self.workers.stop()

    # ---- the loop thread ----

    async def _start(self) -> int:
        import uvicorn

        def models(key: str) -> tuple[int, dict]:
            if key not in self._by_key:
                self.refused += 1
                return 401, EndpointError(401, "a valid API key is required", "invalid_api_key").body()
            return 200, {
                "object": "list",
                "data": [{"id": self.served.model, "object": "model", "owned_by": "titanrl"}],
            }

        config = uvicorn.Config(
            build_app(self._handle, models),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            log_config=None,  # the trainer's logging stays as it is; uvicorn's warnings reach its handlers
            lifespan="off",
            access_log=False,
            # Past the clients' own idle expiry (httpx's is 5 s, uvicorn's default too): a client
            # never reuses a connection that the endpoint is closing (a reset, not a retry).
            timeout_keep_alive=_KEEP_ALIVE_S,
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()
                raise RuntimeError("the agent endpoint stopped at start")
            await asyncio.sleep(0.01)
        self.workers.attach(self._on_message, self._on_exit)
        self._watchdog = asyncio.create_task(self._watch())
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def _handle(self, route: str, key: str, body: Any) -> tuple[int, dict]:
        eid = self._by_key.get(key)
        if eid is None:
            self.refused += 1
            return 401, EndpointError(401, "a valid API key is required", "invalid_api_key").body()
        ep = self._episodes.get(eid)
        if ep is None or ep.failed or ep.over:
            return 409, EndpointError(409, "this episode's sample is over", "episode_over").body()
        try:
            request = parse_request(route, body, self.served)
            if ep.pending is not None:
                raise EndpointError(409, "one model call at a time per episode", reason="invalid: concurrent calls")
        except EndpointError as e:
            if e.reason:
                self._fail(ep, e.reason)
            return e.status, e.body()
        ep.pending = asyncio.get_running_loop().create_future()
        ep.events.put_nowait(("request", request))
        answer = await ep.pending
        if isinstance(answer, EndpointError):
            return answer.status, answer.body()
        return 200, answer

    def _fail(self, ep: _Episode, reason: str) -> None:
        """End episode `ep` with `reason`: its pending call refused, its agent cancelled."""
        if ep.failed:
            return
        ep.failed = reason
        ep.events.put_nowait(("fail", reason))
        ep.answer(EndpointError(409, f"the episode failed: {reason}", "episode_failed"))
        ep.cancel()

    async def _reset(self, episode: int, sample: dict) -> None:
        key = f"{self.secret}-{episode}"
        worker = self.workers.least_loaded()
        ep = _Episode(episode, key, worker, time.monotonic() + self.agent.timeout_s)
        self._episodes[episode], self._by_key[key] = ep, episode
        worker.episodes.add(episode)
        kwargs = {"base_url": self.base_url, "api_key": key, "model": self.served.model, "row": sample}
        if not worker.send(("run", episode, kwargs)):
            self._on_exit(worker)
        await self._next(ep)

    async def _step(self, episode: int, text: str) -> None:
        """Answer the episode's pending call with `text` (the reply's JSON, or a refusal's: then
        the sample is over), then wait for the episode's next event."""
        ep = self._episodes.get(episode)
        if ep is None:
            self._events.put(AgentEvent(episode, "fail", error="crash: the episode is gone"))
            return
        answer = json.loads(text)
        if "refused" in answer:
            ep.over = True
            answer = EndpointError(*answer["refused"])
        ep.answer(answer)
        await self._next(ep)

    async def _next(self, ep: _Episode) -> None:
        kind, value = await ep.events.get()
        if kind == "fail":
            self._events.put(AgentEvent(ep.eid, "fail", error=value))
        else:
            self._events.put(AgentEvent(ep.eid, kind, value))

    async def _close(self, episode: int) -> None:
        ep = self._episodes.pop(episode, None)
        if ep is None:
            return
        self._by_key.pop(ep.key, None)
        ep.answer(EndpointError(409, "this episode's sample is over", "episode_over"))
        ep.events.put_nowait(("fail", "closed"))  # a call still waiting for its event gets one
        ep.cancel()
        if not ep.running:
            ep.worker.episodes.discard(episode)

    async def _close_all(self) -> None:
        for eid in list(self._episodes):
            await self._close(eid)
        self._watchdog.cancel()
        self._server.should_exit = True
        await asyncio.wait([self._serving], timeout=5.0)
        self.workers.detach_all()

    # ---- workers ----

    def _on_message(self, w: AgentWorker, message: tuple) -> None:
        """A worker's message: an agent's end ('done'), failure ('error') or cancellation."""
        kind, eid = message[0], message[1]
        w.episodes.discard(eid)
        ep = self._episodes.get(eid)
        if ep is None:
            return
        ep.running = False
        ep.answer(EndpointError(409, "the agent has returned", "episode_over"))
        if kind == "done":
            ep.events.put_nowait(("end", message[2]))
        elif kind == "error":
            self._fail(ep, "error: " + message[2].splitlines()[0][:480])

    def _on_exit(self, w: AgentWorker, reason: str = "crash: the agent worker exited") -> None:
        """Worker `w` exited (or is stuck): the episodes it ran fail with `reason`; it is replaced."""
        for eid in list(w.episodes):
            ep = self._episodes.get(eid)
            if ep is not None:
                ep.running = False
                self._fail(ep, reason)
        w.episodes.clear()
        asyncio.get_running_loop().create_task(self.workers.replace(w))

    async def _watch(self) -> None:
        """Episodes past their deadline fail ('timeout'); a worker that does not let a cancelled
        agent go within the grace is replaced."""
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for ep in list(self._episodes.values()):
                if ep.running and now > ep.deadline and not ep.failed:
                    self._fail(ep, "timeout")
                stuck = ep.cancelled_at is not None and now > ep.cancelled_at + _CANCEL_GRACE_S
                if ep.running and stuck and ep.worker in self.workers.workers:
                    self._on_exit(ep.worker, "crash: the agent worker was replaced (an agent would not stop)")

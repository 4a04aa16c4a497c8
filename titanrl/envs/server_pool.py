"""Environment episodes against OpenEnv servers, with `EnvPool`'s interface (reset / step /
close_episode / poll -> EnvResult), so `MultiTurnRollout` drives them unchanged.

Each episode is one session on OpenEnv's WebSocket endpoint (`/ws`): OpenEnv's HTTP `/reset`
and `/step` build a fresh environment per request, so a multi-turn episode needs the session
(`websockets`' asyncio client; `httpx` only checks `/health` at start). All I/O runs in one
background event-loop thread: calls are submitted without waiting and their results collected
by `poll`, so hundreds of episodes are in flight per rank while the generator decodes. A new
episode goes to the least-loaded server (fewest open sessions). Every call has a deadline
(`timeout_s`); a reset (a new session) is retried on the next server up to `reset_retries`
times; a step never is (it is not idempotent). A server at capacity (OpenEnv's
CAPACITY_REACHED: all its `max_concurrent_envs` sessions open, or still being torn down) is
busy, not broken: the reset waits with backoff for a free session, on any server, up to
`timeout_s`, without using a retry. A failure ends its episode with a reason that the
reward-failure metrics count by its first word: 'crash: ...' (server died or unreachable),
'timeout', 'invalid: ...' (malformed JSON, a wrong shape), 'error: ...' (an HTTP status at the
handshake or the server's error message). A server unreachable at start is a one-line error.
"""

import asyncio
import json
import time
from typing import Any

from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.pool import EnvResult, validate_step

_CLOSE_S = 2.0
"""How long a closing session waits for its server's close handshake before dropping it."""


def _ws_url(url: str) -> str:
    base = url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            return ws + base[len(http) :] + "/ws"
    raise ValueError(f"[env] urls: {url!r} must start with http:// or https://")


def check_health(urls: list[str], headers: dict, deadline_s: float) -> None:
    """Wait until every server answers `GET /health` (servers that are starting get `deadline_s`);
    a server that never does is a one-line ValueError."""
    import httpx

    for url in urls:
        _ws_url(url)
        end, why = time.monotonic() + deadline_s, ""
        while True:
            try:
                reply = httpx.get(url.rstrip("/") + "/health", headers=headers, timeout=5.0)
                if reply.status_code == 200:
                    break
                why = f"HTTP {reply.status_code}" + (": wrong or missing token" if reply.status_code == 401 else "")
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() > end or why.startswith("HTTP 401"):
                raise ValueError(
                    f"[env] environment server {url} is unreachable at start ({why}); start it or fix [env] urls"
                )
            time.sleep(0.2)


class ServerBusy(RuntimeError):
    """The server has no free session (OpenEnv's CAPACITY_REACHED error)."""


def failure_reason(e: BaseException, url: str) -> str:
    """A named, counted reason for a failed call (the first word is the metric's)."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(e, InvalidStatus):
        return f"error: HTTP {e.response.status_code} from {url}"
    if isinstance(e, ConnectionClosed):
        return f"crash: {url} closed the session ({e.rcvd.code if e.rcvd else 'no close frame'})"
    if isinstance(e, json.JSONDecodeError):
        return f"invalid: malformed JSON from {url}"
    if isinstance(e, ValueError):
        return f"invalid: {e}"
    if isinstance(e, OSError):
        return f"crash: {url} unreachable ({e.strerror or e})"
    return f"error: {type(e).__name__}: {e}"[:500]


class ServerEnvPool(AsyncEnvPool):
    def __init__(
        self,
        urls: list[str],
        timeout_s: float = 10.0,
        reset_retries: int = 2,
        token: str | None = None,
        action_field: str = "text",
        observation_field: str = "text",
        startup_timeout_s: float = 30.0,
        on_close: Any = None,
    ) -> None:
        """`on_close`: called by `close` after the sessions end (stops servers this run started)."""
        assert urls, "ServerEnvPool needs at least one server URL"
        self.urls, self.timeout_s, self.reset_retries = list(urls), timeout_s, reset_retries
        self.action_field, self.observation_field = action_field, observation_field
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.on_close = on_close
        check_health(self.urls, self.headers, startup_timeout_s)
        self.load = {url: 0 for url in self.urls}
        """Open sessions per server (touched only on the loop thread)."""
        self._sessions: dict[int, tuple[str, Any]] = {}
        super().__init__("env-servers")
        # A backstop only: each call's own deadline (retries included) answers well before it.
        self.poll_backstop_s = self.timeout_s * (self.reset_retries + 3) + 30.0

    def close(self) -> None:
        """End every session, stop the loop thread, then `on_close`."""
        self._stop_loop(close_timeout_s=10.0)
        if self.on_close is not None:
            self.on_close()
            self.on_close = None

    # ---- the loop thread ----

    async def _call(self, ws: Any, message: dict) -> dict:
        """Send one message and read its reply, within the deadline; the reply's `data`."""
        from websockets.exceptions import ConnectionClosed

        try:
            await asyncio.wait_for(ws.send(json.dumps(message, default=str)), self.timeout_s)
        except ConnectionClosed:  # a server refusing the session (at capacity) says why, then closes
            pass
        reply = json.loads(await asyncio.wait_for(ws.recv(), self.timeout_s))
        if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
            raise ValueError("the server's reply is not {'type': ..., 'data': {...}}")
        if reply.get("type") == "error" and reply["data"].get("code") == "CAPACITY_REACHED":
            raise ServerBusy(str(reply["data"].get("message", "capacity reached"))[:500])
        if reply.get("type") == "error":
            raise RuntimeError(str(reply["data"].get("message", "server error"))[:500])
        return reply["data"]

    def _text(self, data: dict) -> tuple[str, dict]:
        """(observation text, the observation's other fields) of an OpenEnv observation message."""
        obs = data.get("observation")
        if not isinstance(obs, dict) or not isinstance(obs.get(self.observation_field), str):
            raise ValueError(f"the observation has no str field {self.observation_field!r} ([env] observation_field)")
        return obs[self.observation_field], {k: v for k, v in obs.items() if k != self.observation_field}

    async def _open(self, url: str, sample: dict) -> tuple[Any, str]:
        from websockets.asyncio.client import connect

        ws = await asyncio.wait_for(
            connect(_ws_url(url), additional_headers=self.headers, ping_interval=None, max_size=2**22),
            self.timeout_s,
        )
        try:
            text, _ = self._text(await self._call(ws, {"type": "reset", "data": sample}))
            if not text:
                raise ValueError("reset() must return a non-empty observation")
        except BaseException:
            await ws.close()
            raise
        return ws, text

    async def _reset(self, episode: int, sample: dict) -> None:
        reason, tried, retries = "", set(), self.reset_retries
        busy_until, backoff_s = time.monotonic() + self.timeout_s, 0.05
        while retries >= 0:
            url = min([u for u in self.urls if u not in tried] or self.urls, key=lambda u: self.load[u])
            tried.add(url)
            self.load[url] += 1
            try:
                ws, text = await self._open(url, sample)
            except ServerBusy as e:  # waits for a session to free up; not a retry
                self.load[url] -= 1
                if time.monotonic() + backoff_s > busy_until:
                    reason = (
                        f"timeout: no free session for {self.timeout_s:g} s ({e}); "
                        "add servers ([env] servers / urls) or raise their max_concurrent_envs"
                    )
                    break
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 1.0)
                continue
            except Exception as e:  # noqa: BLE001 - a failed reset is retried, then fails its episode
                self.load[url] -= 1
                reason, retries = failure_reason(e, url), retries - 1
                continue
            self._sessions[episode] = (url, ws)
            self._results.put(EnvResult(episode, "reset", text))
            return
        self._results.put(EnvResult(episode, "reset", None, reason))

    async def _step(self, episode: int, text: str) -> None:
        if episode not in self._sessions:
            self._results.put(EnvResult(episode, "step", None, "crash: the episode's session is gone"))
            return
        url, ws = self._sessions[episode]
        try:
            data = await self._call(ws, {"type": "step", "data": {self.action_field: text}})
            obs, info = self._text(data)
            reward = 0.0 if data.get("reward") is None else data["reward"]
            result = validate_step((obs, reward, bool(data.get("done", False)), info))
        except Exception as e:  # noqa: BLE001 - a failed step ends its episode, never the run
            self._results.put(EnvResult(episode, "step", None, failure_reason(e, url)))
            await self._close(episode)
            return
        self._results.put(EnvResult(episode, "step", result))

    async def _close(self, episode: int) -> None:
        if episode not in self._sessions:
            return
        url, ws = self._sessions.pop(episode)
        self.load[url] -= 1
        try:  # the server ends the session and closes: a clean close handshake, no error in its log
            await asyncio.wait_for(ws.send('{"type": "close"}'), _CLOSE_S)
            await asyncio.wait_for(ws.wait_closed(), _CLOSE_S)
        except Exception:  # noqa: BLE001 - the session may be dead already, or its server deaf
            if ws.transport is not None:
                ws.transport.abort()

    async def _close_all(self) -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:  # calls in flight (a close_episode's) end first
            await asyncio.wait(others, timeout=self.timeout_s)
        await asyncio.gather(*(self._close(episode) for episode in list(self._sessions)))

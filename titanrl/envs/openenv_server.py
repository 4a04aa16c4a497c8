"""titanrl's environments as OpenEnv-compatible servers (`titanrl serve-env NAME --port 0`).

The routes and message shapes are OpenEnv's (`openenv-core`, `openenv/core/env_server/`):
`GET /health`, `GET /metadata`, `GET /schema`, the stateless `POST /reset` and `POST /step`
(each on a fresh environment, as OpenEnv's are) and the session endpoint `WS /ws`, one environment
per connection: the client sends `{"type": "reset", "data": {...}}`, `{"type": "step", "data":
{action}}`, `{"type": "state"}` or `{"type": "close"}` and gets `{"type": "observation", "data":
{"observation": {...}, "reward": r, "done": d}}` (or `{"type": "state", ...}`, `{"type": "error",
"data": {"message", "code"}}`). The action is `{"text": model_text}`; the observation is
`{"text": observation, **info}` (e.g. `correct`, `tool_call`); reset's data is the sample
(`prompt`, `answer`, `metadata`). These are implemented here, not imported from openenv-core:
its package takes many seconds to import, and a server per rank starts on every run; the tests
drive these servers with openenv-core's own client to show the protocol is the same.

Security: a server binds 127.0.0.1 unless told otherwise; another address needs a shared token
(`TITANRL_ENV_TOKEN` or `--token-file`, never the config's text) and every request must then
carry `Authorization: Bearer <token>` (HTTP 401 / WebSocket refused without it). The Python
sandbox runs each call in a fresh child with CPU-time and address-space limits, in a new network
namespace where the kernel allows it, and as `nobody` when the server runs as root.
"""

import argparse
import asyncio
import ctypes
import hmac
import json
import os
import pwd
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from titanrl.components.console import get_logger
from titanrl.envs.builtin import PythonSandboxEnv
from titanrl.envs.pool import resolve_env, validate_step

log = get_logger(__name__)

TOKEN_ENV = "TITANRL_ENV_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_CLONE_NEWNET = 0x40000000


def read_token(token_file: str = "") -> str | None:
    """The shared token: the file's first line when `token_file` is set, else $TITANRL_ENV_TOKEN."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            raise ValueError(f"env token file '{token_file}' cannot be read ({e.strerror})") from None
        if not token:
            raise ValueError(f"env token file '{token_file}' is empty: write the shared token on its first line")
        return token
    return os.environ.get(TOKEN_ENV) or None


def check_bind(host: str, token: str | None) -> None:
    """Only loopback without a token: a server other hosts can reach must check one."""
    if host not in LOOPBACK and token is None:
        raise ValueError(
            f"serve-env: binding {host!r} makes the environment reachable from other hosts; set a shared token "
            f"in ${TOKEN_ENV} or --token-file (or bind 127.0.0.1)"
        )


# ---- the sandbox jail ----


def _unshare_net() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(_CLONE_NEWNET) == 0


def probe_jail() -> dict[str, bool]:
    """What the sandbox's children get here: a network namespace of their own, the user nobody."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _unshare_net() else 1)
    _, status = os.waitpid(pid, 0)
    nobody = os.geteuid() == 0 and _nobody() is not None
    if nobody:  # nobody must be able to run this interpreter (not so under a private /root/.pyenv)
        run = [sys.executable, "-I", "-S", "-c", "pass"]
        jail = {"no_network": False, "nobody": True}
        try:
            nobody = subprocess.run(run, preexec_fn=make_jail(jail), capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            nobody = False
    return {"no_network": os.waitstatus_to_exitcode(status) == 0, "nobody": nobody}


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


def make_jail(jail: dict[str, bool]):
    """The sandbox child's preexec: no network, then drop root to nobody (where `jail` allows)."""

    def preexec() -> None:
        if jail["no_network"] and not _unshare_net():
            os._exit(126)  # refuse to run the code with network access it was promised not to have
        if jail["nobody"]:
            user = _nobody()
            assert user is not None, "jail['nobody'] is set only where the user exists"
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)

    return preexec


# ---- the server ----


def _observation(obs: str, reward: float | None, done: bool, info: dict) -> dict:
    extra = {k: v for k, v in info.items() if k != "text" and isinstance(v, (str, int, float, bool))}
    return {"observation": {"text": obs, **extra}, "reward": reward, "done": done}


class Session:
    """One episode's environment behind a WebSocket connection."""

    def __init__(self, cls: type, kwargs: dict, jail: dict[str, bool] | None) -> None:
        self.env = cls(**kwargs)
        if jail is not None and isinstance(self.env, PythonSandboxEnv):
            self.env.preexec_fn = make_jail(jail)
        self.steps = 0

    def handle(self, message: dict) -> dict | None:
        """OpenEnv's WebSocket message -> its response (None: close)."""
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "reset":
            sample = {"prompt": data.get("prompt", ""), "answer": data.get("answer", ""), **data}
            obs = self.env.reset(sample)
            return {"type": "observation", "data": _observation(obs, None, False, {})}
        if kind == "step":
            self.steps += 1
            step = validate_step(self.env.step(str(data.get("text", ""))))
            return {"type": "observation", "data": _observation(step.observation, step.reward, step.done, step.info)}
        if kind == "state":
            return {"type": "state", "data": {"episode_id": None, "step_count": self.steps}}
        if kind == "close":
            return None
        return {"type": "error", "data": {"message": f"Unknown message type: {kind}", "code": "UNKNOWN_TYPE"}}


def _authorized(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    if token is None:
        return True
    got = dict(headers).get(b"authorization", b"").decode("latin-1")
    return hmac.compare_digest(got, f"Bearer {token}")


def token_middleware(app: Any, token: str | None) -> Any:
    """ASGI wrapper: without the right bearer token, HTTP gets 401 and a WebSocket is refused."""

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or _authorized(scope.get("headers", []), token):
            return await app(scope, receive, send)
        body = b'{"detail": "missing or wrong token"}'
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"json")]})
            return await send({"type": "http.response.body", "body": body})
        if "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": []})
            return await send({"type": "websocket.http.response.body", "body": body})
        await send({"type": "websocket.close", "code": 1008})

    return guarded


def build_app(name: str, kwargs: dict | None = None, token: str | None = None, jail: dict | None = None) -> Any:
    """The FastAPI app serving environment `name` (a built-in or 'module:Class')."""
    from fastapi import FastAPI, HTTPException, WebSocket, WebSocketDisconnect

    cls, kwargs = resolve_env(name), kwargs or {}
    app = FastAPI(title=f"titanrl env {name}")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "healthy"}

    @app.get("/metadata")
    async def metadata() -> dict:
        return {"name": name, "description": (cls.__doc__ or name).strip().splitlines()[0]}

    @app.get("/schema")
    async def schema() -> dict:
        text = {"type": "object", "properties": {"text": {"type": "string"}}}
        return {"action": text, "observation": text, "state": {"type": "object"}}

    @app.post("/reset")
    async def reset(request: dict | None = None) -> dict:
        reply = await asyncio.to_thread(Session(cls, kwargs, jail).handle, {"type": "reset", "data": request or {}})
        assert reply is not None, "a reset is answered with an observation"
        return reply["data"]

    @app.post("/step")
    async def step(request: dict) -> dict:
        if not isinstance(request.get("action"), dict):
            raise HTTPException(422, "the body must be {'action': {'text': ...}}")
        session = Session(cls, kwargs, jail)
        reply = await asyncio.to_thread(session.handle, {"type": "step", "data": request["action"]})
        assert reply is not None, "a step is answered with an observation"
        return reply["data"]

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            session = await asyncio.to_thread(Session, cls, kwargs, jail)
            while True:
                reply = await _ws_reply(session, await websocket.receive_text())
                if reply is None:
                    break
                await websocket.send_text(json.dumps(reply))
            await websocket.close()
        except (WebSocketDisconnect, RuntimeError):  # the client went away (it aborts a closed session)
            return

    return token_middleware(app, token)


async def _ws_reply(session: "Session", raw: str) -> dict | None:
    try:
        message = json.loads(raw)
    except json.JSONDecodeError as e:
        return {"type": "error", "data": {"message": f"Invalid JSON: {e}", "code": "INVALID_JSON"}}
    try:
        return await asyncio.to_thread(session.handle, message)
    except Exception as e:  # noqa: BLE001 - the environment's failure ends its episode, not the server
        return {"type": "error", "data": {"message": f"{type(e).__name__}: {e}", "code": "EXECUTION_ERROR"}}


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until uvicorn serves: the printed port is ready
    return sock


def serve(name: str, sock: socket.socket, token: str | None, kwargs: dict | None = None) -> None:
    """Run the server on a bound socket until it is killed."""
    import uvicorn

    jail = probe_jail() if issubclass(resolve_env(name), PythonSandboxEnv) else None
    host, port = sock.getsockname()[:2]
    log.info(
        f"titanrl serve-env: '{name}' on http://{host}:{port} "
        f"({'token required' if token else 'no token: loopback only'}"
        + (f"; sandbox: no network {jail['no_network']}, user nobody {jail['nobody']}" if jail else "")
        + ")"
    )
    app = build_app(name, kwargs, token, jail)
    config = uvicorn.Config(app, log_level="warning", ws_ping_interval=None, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])


def serve_main(argv: list[str]) -> int:
    """`titanrl serve-env NAME [--host H] [--port P] [--token-file F]`."""
    parser = argparse.ArgumentParser(prog="titanrl serve-env", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a built-in env (calculator, python, guess_number) or module:Class")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed at start)")
    parser.add_argument("--token-file", default="", help=f"the shared token's file (else ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    try:
        require_extra()
        resolve_env(args.name)
        token = read_token(args.token_file)
        check_bind(args.host, token)
        sock = bind(args.host, args.port)
    except (ValueError, OSError) as e:
        log.error(f"titanrl: error: {e}")
        return 2
    serve(args.name, sock, token)
    return 0


def require_extra() -> None:
    """A one-line error naming the extra when the server packages are missing."""
    for module in ("fastapi", "uvicorn", "websockets", "httpx"):
        try:
            __import__(module)
        except ImportError:
            raise ValueError(f"environment servers need '{module}': pip install 'titanrl[envs]'") from None


def contained_main(fd: int) -> None:
    """A local server started by a run (`titanrl/envs/pool_builder.py`), in a containment keeper:
    reads {name, kwargs, token, sys_path} on `fd`, binds 127.0.0.1:0 and sends the port back."""
    conn = Connection(fd)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    sock = bind("127.0.0.1", 0)
    conn.send(sock.getsockname()[1])
    conn.close()
    serve(init["name"], sock, init["token"], init["kwargs"])

"""The run's environment pool: in-process workers (`EnvPool`), servers (`ServerEnvPool`) that
the run starts (`[env] servers`: `titanrl serve-env` processes, each in a containment keeper that
kills it with the run) or that run elsewhere (`[env] urls`), or a verifiers environment's
rollouts (`VerifiersEnvPool`, `[env] verifiers`)."""

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from titanrl.components.containment import announce, spawn_contained, stop_contained
from titanrl.config.rewards_envs import Env
from titanrl.envs.openenv_server import read_token, require_extra
from titanrl.envs.pool import EnvPool
from titanrl.envs.server_pool import ServerEnvPool
from titanrl.envs.verifiers_pool import VerifiersEnvPool

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LocalServers:
    """`count` servers of environment `name` on 127.0.0.1, each under a containment keeper."""

    def __init__(self, name: str, kwargs: dict, count: int, token: str | None, startup_timeout_s: float) -> None:
        announce("environment server")
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        try:
            for _ in range(count):
                self._start(name, kwargs, token, startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, kwargs: dict, token: str | None, startup_timeout_s: float) -> None:
        parent, child = socket.socketpair()
        try:
            self.procs.append(
                spawn_contained("titanrl.envs.openenv_server:contained_main", (child.fileno(),), None, _ROOT)
            )
        finally:
            child.close()
        conn = Connection(parent.detach())
        try:
            conn.send({"name": name, "kwargs": kwargs, "token": token, "sys_path": list(sys.path)})
            if not conn.poll(startup_timeout_s):
                raise ValueError(f"[env] a local '{name}' server did not start in {startup_timeout_s:g} s")
            self.urls.append(f"http://127.0.0.1:{conn.recv()}")
        except EOFError:
            raise ValueError(f"[env] a local '{name}' server exited at start (see its output above)") from None
        finally:
            conn.close()

    def stop(self) -> None:
        for proc in self.procs:
            stop_contained(proc)
        self.procs = []


def build_env_pool(
    env: Env, memory_limit_mb: int, env_kwargs: dict | None = None
) -> EnvPool | ServerEnvPool | VerifiersEnvPool:
    """The pool `[env]` asks for: a verifiers environment's rollouts when `verifiers` is set,
    servers when `servers` or `urls` are, else worker processes. `env_kwargs`: the environment's
    constructor arguments (e.g. its tool format, which the verifiers pool reads tool calls in)."""
    kwargs = dict(env_kwargs or {})
    if env.verifiers:
        return VerifiersEnvPool(env.verifiers, env.timeout_s, kwargs.get("tool_format", "tag"))
    if not env.servers and not env.urls:
        return EnvPool(env.name, kwargs, env.num_workers, env.timeout_s, memory_limit_mb)
    require_extra()
    token = read_token(env.token_file)
    local = LocalServers(env.name, kwargs, env.servers, token, env.startup_timeout_s) if env.servers else None
    try:
        return ServerEnvPool(
            list(env.urls) + (local.urls if local else []),
            env.timeout_s,
            env.reset_retries,
            token,
            env.action_field,
            env.observation_field,
            env.startup_timeout_s,
            on_close=local.stop if local else None,
        )
    except BaseException:
        if local is not None:
            local.stop()
        raise

"""The trainer's side of the agent workers (`agent_worker.py`): each a process under a
containment keeper (`titanrl/components/containment.py`), as environment workers are, so that
whatever an agent starts dies with its worker and every worker dies with the rank. `AgentWorkers`
lives on `AgentPool`'s event-loop thread: it reads the workers' messages there and replaces a
worker that exited or would not let a cancelled agent go."""

import asyncio
import os
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection

from titanrl.components.containment import spawn_contained, stop_contained

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class AgentWorker:
    """One agent worker: its keeper, its socket and the episodes it runs."""

    def __init__(self, init: dict, startup_timeout_s: float) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = spawn_contained("titanrl.envs.agent_worker:agent_worker_main", (child.fileno(),), None, _ROOT)
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.episodes: set[int] = set()
        self.conn.send(init)
        try:
            if not self.conn.poll(startup_timeout_s):
                raise ValueError(f"[agent] a worker did not load {init['spec']!r} in {startup_timeout_s:g} s")
            message = self.conn.recv()
        except EOFError:
            message = ("fatal", -1, f"[agent] the worker exited loading {init['spec']!r} (see its output above)")
        except BaseException:
            self.stop()
            raise
        if message[0] != "ready":
            self.stop()
            raise ValueError(message[2])

    def send(self, message: tuple) -> bool:
        """Send `message`; False if the worker is gone."""
        try:
            self.conn.send(message)
            return True
        except OSError:
            return False

    def stop(self) -> None:
        self.conn.close()
        stop_contained(self.proc)


class AgentWorkers:
    def __init__(self, init: dict, count: int, startup_timeout_s: float) -> None:
        """`count` workers running `init['spec']` (started here, in the trainer's thread)."""
        self.init, self.startup_timeout_s = init, startup_timeout_s
        self.workers: list[AgentWorker] = []
        self.on_message: Callable[[AgentWorker, tuple], None] = lambda w, m: None
        self.on_exit: Callable[[AgentWorker], None] = lambda w: None
        try:
            for _ in range(count):
                self.workers.append(AgentWorker(init, startup_timeout_s))
        except BaseException:
            self.stop()
            raise

    def attach(self, on_message: Callable[[AgentWorker, tuple], None], on_exit: Callable[[AgentWorker], None]) -> None:
        """Read the workers' messages on the running loop: `on_message(worker, message)`, and
        `on_exit(worker)` when one exits."""
        self.on_message, self.on_exit = on_message, on_exit
        for w in self.workers:
            asyncio.get_running_loop().add_reader(w.conn.fileno(), self._receive, w)

    def least_loaded(self) -> AgentWorker:
        return min(self.workers, key=lambda w: len(w.episodes))

    def _receive(self, w: AgentWorker) -> None:
        try:
            while True:
                self.on_message(w, w.conn.recv())
                if not w.conn.poll():
                    return
        except (EOFError, OSError):
            self._detach(w)
            self.on_exit(w)

    def _detach(self, w: AgentWorker) -> None:
        try:
            asyncio.get_running_loop().remove_reader(w.conn.fileno())
        except (ValueError, OSError):
            pass

    async def replace(self, w: AgentWorker) -> None:
        """Kill worker `w` (and all it started) and start a fresh one in its slot."""
        if w not in self.workers:
            return
        self._detach(w)
        loop = asyncio.get_running_loop()
        index = self.workers.index(w)
        self.workers[index] = fresh = await loop.run_in_executor(None, AgentWorker, self.init, self.startup_timeout_s)
        loop.add_reader(fresh.conn.fileno(), self._receive, fresh)
        await loop.run_in_executor(None, w.stop)

    def detach_all(self) -> None:
        for w in self.workers:
            self._detach(w)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

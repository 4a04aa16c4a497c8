"""The process that runs agent episodes (`[agent] function`), started by `AgentPool` under a
containment keeper as environment workers are (`titanrl/envs/pool.py`).

One worker runs many episodes at once: each is a task on the worker's event loop that awaits
the user's `run(base_url=, api_key=, model=, row=)`. Requests come on the socket from the pool:
('run', episode, kwargs) and ('cancel', episode); the worker answers ('done', episode, reward),
('error', episode, message) or ('cancelled', episode). A reward is a finite number or None
(None: the trainer scores the transcript with [reward]); anything else is an error. A worker
whose agent blocks its loop (a synchronous hang) stops answering and is replaced by the pool.
"""

import asyncio
import math
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from titanrl.components.plugins import load_object
from titanrl.components.worker_setup import init_worker


def checked_reward(value: Any) -> float | None:
    """An agent's return value as a reward (None stays None); ValueError if it is not one."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the agent must return a finite number or None, got {value!r}")
    return float(value)


class _Worker:
    def __init__(self, conn: Connection, fn: Any) -> None:
        self.conn, self.fn = conn, fn
        self.tasks: dict[int, asyncio.Task] = {}
        self.me = os.getpid()

    def send(self, message: tuple) -> None:
        if os.getpid() != self.me:  # a process the agent's code forked must not answer
            os._exit(0)
        self.conn.send(message)

    async def episode(self, eid: int, kwargs: dict) -> None:
        try:
            reward = checked_reward(await self.fn(**kwargs))
        except asyncio.CancelledError:
            self.send(("cancelled", eid))
            return
        except BaseException as e:  # noqa: BLE001 - any failure of the agent ends only its episode
            tail = traceback.format_exc(limit=3)
            self.send(("error", eid, f"{type(e).__name__}: {e}\n{tail}"[:2000]))
            return
        finally:
            self.tasks.pop(eid, None)
        self.send(("done", eid, reward))

    def handle(self, message: tuple) -> None:
        op, eid = message[0], message[1]
        if op == "run":
            self.tasks[eid] = asyncio.get_running_loop().create_task(self.episode(eid, message[2]))
        elif op == "cancel":
            task = self.tasks.get(eid)
            if task is None:
                self.send(("cancelled", eid))
            else:
                task.cancel()


def _read(conn: Connection, loop: asyncio.AbstractEventLoop, worker: _Worker, done: asyncio.Event) -> None:
    """The reader thread: requests from the pool onto the worker's loop; EOF ends the worker."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            loop.call_soon_threadsafe(done.set)
            return
        loop.call_soon_threadsafe(worker.handle, message)


async def _serve(conn: Connection, fn: Any) -> None:
    worker, done = _Worker(conn, fn), asyncio.Event()
    loop = asyncio.get_running_loop()
    threading.Thread(target=_read, args=(conn, loop, worker, done), daemon=True).start()
    await done.wait()


def agent_worker_main(fd: int) -> None:
    """The agent worker (run by its keeper): requests and results on the socket `fd`."""
    conn = Connection(fd)
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    try:
        fn = load_object(init["spec"], "[agent] function")
    except ValueError as e:  # one line naming the module (or file:line), for the trainer to raise
        conn.send(("fatal", -1, str(e)))
        return
    if not asyncio.iscoroutinefunction(fn):
        conn.send(("fatal", -1, f"[agent] function {init['spec']!r} must be an async function (async def)"))
        return
    init_worker(init["memory_limit_mb"])
    conn.send(("ready", -1))
    asyncio.run(_serve(conn, fn))

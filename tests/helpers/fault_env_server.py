"""A misbehaving OpenEnv-protocol server for the fault tests: `python fault_env_server.py MODE`
prints its port and serves /health and /ws (raw `websockets`, so that it can break the protocol).

MODE: 'hang' (a step never answers), 'malformed' (a step answers text that is not JSON),
'http500' (the WebSocket handshake answers HTTP 500), 'die' (the process exits mid-step), 'full'
(one session at a time: another is refused with OpenEnv's CAPACITY_REACHED error, as
openenv-core's server does at max_concurrent_envs)."""

import asyncio
import json
import os
import sys
from http import HTTPStatus

from websockets.asyncio.server import serve

MODE = sys.argv[1]
FULL = {"type": "error", "data": {"message": "Server capacity reached: 1/1 sessions", "code": "CAPACITY_REACHED"}}
OPEN = set()
OBS = {"type": "observation", "data": {"observation": {"text": "ready"}, "reward": None, "done": False}}


def process_request(connection, request):
    if request.path == "/health":
        return connection.respond(HTTPStatus.OK, '{"status": "healthy"}\n')
    if MODE == "http500":
        return connection.respond(HTTPStatus.INTERNAL_SERVER_ERROR, "boom\n")
    return None


async def session(ws):
    if MODE == "full" and OPEN:
        await ws.send(json.dumps(FULL))
        return
    OPEN.add(ws)
    try:
        await serve_session(ws)
    finally:
        OPEN.discard(ws)


async def serve_session(ws):
    async for raw in ws:
        kind = json.loads(raw)["type"]
        if kind == "close":
            return
        if kind == "reset":
            await ws.send(json.dumps(OBS))
        elif kind == "step" and MODE == "hang":
            await asyncio.sleep(3600)
        elif kind == "step" and MODE == "malformed":
            await ws.send("{not json")
        elif kind == "step" and MODE == "die":
            os._exit(1)


async def main():
    async with serve(session, "127.0.0.1", 0, process_request=process_request) as server:
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Future()


asyncio.run(main())

"""Environment servers on localhost: titanrl's served environments, openenv-core's echo
environment and misbehaving servers, driven by `ServerEnvPool` (titanrl/envs/server_pool.py)."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque

import pytest
from helpers.launch import REPO_ROOT, run_cmd
from helpers.tiny import smoke_run_args

from titanrl.envs.openenv_server import make_jail, probe_jail
from titanrl.envs.server_pool import ServerEnvPool

httpx = pytest.importorskip("httpx")

for _module in ("websockets", "fastapi", "uvicorn", "openenv"):  # the `envs` extra
    pytest.importorskip(_module)
ENV = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
LOGS: dict[str, deque] = {}
"""A started server's last output lines, by base URL (read as it runs: a full pipe blocks a server)."""
CALC_SAMPLE = {"prompt": "4 boxes of 37 pens. pens? ", "answer": "148", "metadata": {}}


def _start(cmd: list[str], env: dict | None = None, cwd: str = REPO_ROOT) -> tuple[subprocess.Popen, str]:
    """Start a server that prints its port on its first line; (process, base URL)."""
    proc = subprocess.Popen(cmd, env=env or ENV, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    found = re.search(r"(\d+)\D*$", line.split("(")[0].strip())
    assert found, f"{cmd} printed {line!r}"
    url = f"http://127.0.0.1:{found.group(1)}"
    LOGS[url] = deque(maxlen=2000)
    threading.Thread(target=LOGS[url].extend, args=(proc.stdout,), daemon=True).start()
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _serve_env(name: str, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    return _start([sys.executable, "-m", "titanrl.cli", "serve-env", name, "--port", "0", *extra], env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _echo_env(folder) -> tuple[subprocess.Popen, str]:
    """openenv-core's echo environment (the template `openenv init` writes), under uvicorn."""
    src = importlib.util.find_spec("openenv.cli.templates.openenv_env").submodule_search_locations[0]
    names = {"__ENV_NAME__": "echo", "__ENV_CLASS_NAME__": "Echo", "__ENV_TITLE_NAME__": "Echo"}
    for rel in ("models.py", "server/__ENV_NAME___environment.py", "server/app.py"):
        text = open(os.path.join(src, rel)).read()
        for key, value in names.items():
            text = text.replace(key, value)
        text = text.replace("max_concurrent_envs=1", "max_concurrent_envs=16")
        dest = os.path.join(folder, rel.replace("__ENV_NAME__", "echo"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        open(dest, "w").write(text)
    open(os.path.join(folder, "server", "__init__.py"), "w").close()
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        f"print({port}, flush=True); import uvicorn; uvicorn.run('server.app:app', port={port})",
    ]
    return _start(cmd, {**ENV, "PYTHONPATH": str(folder)}, cwd=str(folder))


def _wait_healthy(url: str, deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            assert time.monotonic() < end, f"{url} never answered /health"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{name: url} of servers started once for the module (in parallel: their imports are slow)."""
    procs = {
        "calculator": _serve_env("calculator"),
        "python": _serve_env("python"),
        "echo": _echo_env(tmp_path_factory.mktemp("echo")),
    }
    for mode in ("hang", "malformed", "http500", "die", "full"):
        procs[mode] = _start([sys.executable, os.path.join(REPO_ROOT, "tests/helpers/fault_env_server.py"), mode])
    urls = {name: url for name, (_, url) in procs.items()}
    for url in urls.values():  # the echo server prints its port before uvicorn (slow to import) listens
        _wait_healthy(url)
    yield urls
    for proc, _ in procs.values():
        _stop(proc)


def _run(pool: ServerEnvPool, episode: int, op: str, payload) -> object:
    getattr(pool, op)(episode, payload)
    (result,) = pool.poll(block=True)
    assert result.episode == episode and result.op == op
    return result


def test_served_calculator_runs_an_episode(servers):
    pool = ServerEnvPool([servers["calculator"]], timeout_s=20)
    try:
        assert _run(pool, 0, "reset", CALC_SAMPLE).value == CALC_SAMPLE["prompt"]
        step = _run(pool, 0, "step", "<tool>4*37</tool>").value
        assert (step.observation, step.reward, step.done, step.info) == (
            "<result>148</result>",
            0.0,
            False,
            {"tool_call": True},
        )
        step = _run(pool, 0, "step", "<result>148</result>148").value
        assert (step.reward, step.done, step.info["correct"]) == (1.0, True, True)
        pool.close_episode(0)
    finally:
        pool.close()


@pytest.mark.slow  # importing openenv-core's client takes 10-60 s on 2 loaded cores
def test_openenv_client_speaks_to_the_served_calculator(servers):
    """openenv-core's own client against titanrl's server: the protocol is OpenEnv's."""
    from openenv.core.generic_client import GenericEnvClient

    with GenericEnvClient(base_url=servers["calculator"]).sync() as client:
        first = client.reset(**CALC_SAMPLE)
        assert first.observation["text"] == CALC_SAMPLE["prompt"] and first.done is False
        step = client.step({"text": "<tool>4*37</tool>"})
        assert step.observation["text"] == "<result>148</result>" and step.reward == 0.0
        assert client.step({"text": "148"}).reward == 1.0
    assert httpx.get(servers["calculator"] + "/health").json() == {"status": "healthy"}


def test_openenv_echo_environment_through_the_pool(servers):
    """openenv-core's echo environment (its own server code) driven by titanrl's client."""
    pool = ServerEnvPool([servers["echo"]], 20, action_field="message", observation_field="echoed_message")
    try:
        for episode in (0, 1):
            pool.reset(episode, CALC_SAMPLE)
        firsts = pool.poll(block=True)
        while len(firsts) < 2:
            firsts += pool.poll(block=True)
        assert {r.value for r in firsts} == {"Echo environment ready!"}
        step = _run(pool, 1, "step", "hello").value
        assert (step.observation, step.reward, step.done) == ("hello", pytest.approx(0.5), False)
        assert step.info == {"message_length": 5}
    finally:
        pool.close()
    # Sessions end with a close handshake: nothing in the server's log (an aborted connection
    # logs a traceback per episode there).
    time.sleep(0.5)
    assert "Traceback" not in "".join(LOGS[servers["echo"]])


def test_sandbox_server_runs_code_in_a_jail(servers):
    pool = ServerEnvPool([servers["python"]], timeout_s=20)
    try:
        _run(pool, 0, "reset", {"prompt": "sum? ", "answer": "10", "metadata": {}})
        assert _run(pool, 0, "step", "<tool>sum(range(5))</tool>").value.observation == "<result>10</result>"
    finally:
        pool.close()
    jail = probe_jail()
    if not jail["no_network"]:
        pytest.skip("this kernel refuses an unprivileged network namespace")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    code = f"import os, socket; print(os.getuid()); socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=make_jail(jail))
    listener.close()
    assert child.returncode != 0 and ("Network is unreachable" in child.stderr or "refused" in child.stderr)
    assert child.stdout.strip() == ("65534" if jail["nobody"] else str(os.getuid()))
    # The same code outside the jail reaches the port's listener (here: refused, it is closed now).


def test_token_is_required_off_loopback(tmp_path):
    """A server bound off loopback without a shared token, or a request without / with a wrong token -> the server refuses to start (exit 2, one line); requests get 401 (HTTP and WebSocket)."""
    bad = subprocess.run(
        [sys.executable, "-m", "titanrl.cli", "serve-env", "calculator", "--host", "0.0.0.0"],
        env={k: v for k, v in ENV.items() if k != "TITANRL_ENV_TOKEN"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "TITANRL_ENV_TOKEN" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    (tmp_path / "token").write_text("s3cret\n")
    proc, url = _serve_env("calculator", "--host", "0.0.0.0", "--token-file", str(tmp_path / "token"))
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        assert httpx.get(url + "/health").status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for token in (None, "wrong"):
            with pytest.raises(ValueError, match="HTTP 401: wrong or missing token"):
                ServerEnvPool([url], timeout_s=5, token=token, startup_timeout_s=2)
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        with pytest.raises(InvalidStatus, match="401"):
            connect(url.replace("http", "ws") + "/ws")
        pool = ServerEnvPool([url], timeout_s=20, token="s3cret")
        try:
            assert _run(pool, 0, "reset", CALC_SAMPLE).value == CALC_SAMPLE["prompt"]
        finally:
            pool.close()
    finally:
        _stop(proc)


def test_unreachable_at_start_is_one_line():
    """An environment server unreachable at start -> one-line error naming the URL before any episode."""
    with pytest.raises(ValueError) as e:
        ServerEnvPool([f"http://127.0.0.1:{_free_port()}"], timeout_s=1, startup_timeout_s=0.5)
    assert "unreachable at start" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "mode,reason",
    [("hang", "timeout"), ("malformed", "invalid: malformed JSON"), ("die", "crash: ")],
)
def test_a_failing_step_ends_its_episode_with_a_named_reason(servers, mode, reason):
    """An environment server that hangs, returns malformed JSON or is killed mid-step -> that episode fails with a named, counted reason; episodes on a healthy server go on."""
    pool = ServerEnvPool([servers[mode], servers["calculator"]], timeout_s=3, reset_retries=0)
    try:
        pool.reset(0, CALC_SAMPLE)  # least-loaded: the faulty server first, then the calculator
        pool.reset(1, CALC_SAMPLE)
        results = pool.poll(block=True)
        while len(results) < 2:
            results += pool.poll(block=True)
        start = time.monotonic()
        failed = _run(pool, 0, "step", "<tool>1+1</tool>")
        assert failed.value is None and failed.error.startswith(reason), failed.error
        assert time.monotonic() - start < 10
        # The other episode, on a good server, goes on.
        assert _run(pool, 1, "step", "<tool>4*37</tool>").value.observation == "<result>148</result>"
    finally:
        pool.close()


def test_http_500_at_reset_is_retried_then_named(servers):
    """An environment server answering HTTP 500 at reset -> bounded retries on the next server, then a named failure (a step is never retried)."""
    pool = ServerEnvPool([servers["http500"]], timeout_s=3, reset_retries=2)
    try:
        failed = _run(pool, 0, "reset", CALC_SAMPLE)
        assert failed.value is None and failed.error.startswith("error: HTTP 500"), failed.error
    finally:
        pool.close()
    pool = ServerEnvPool([servers["http500"], servers["calculator"]], timeout_s=3, reset_retries=1)
    try:  # the retry goes to the least-loaded other server
        assert _run(pool, 0, "reset", CALC_SAMPLE).value == CALC_SAMPLE["prompt"]
    finally:
        pool.close()


def test_a_server_at_capacity_makes_a_reset_wait_then_name_it(servers):
    """A server with all its sessions open (OpenEnv's CAPACITY_REACHED) -> a reset waits for a free
    session instead of failing (sessions of the last step may still be closing); one that never
    frees up -> a named 'timeout' after timeout_s. Without the wait the reset fails at once."""
    pool = ServerEnvPool([servers["full"]], timeout_s=3, reset_retries=0)
    try:
        assert _run(pool, 0, "reset", CALC_SAMPLE).value == "ready"
        start = time.monotonic()
        failed = _run(pool, 1, "reset", CALC_SAMPLE)
        assert failed.value is None and failed.error.startswith("timeout: no free session"), failed.error
        assert 2.5 < time.monotonic() - start < 10
        pool.reset(1, CALC_SAMPLE)
        time.sleep(0.5)
        assert pool.poll(block=False) == []  # waiting, not failed
        pool.close_episode(0)
        (result,) = pool.poll(block=True)
        assert (result.episode, result.value, result.error) == (1, "ready", None)
    finally:
        pool.close()


# ---- through the trainer: `titanrl run` starts the local servers and leaves none behind ----

SMALL = smoke_run_args(
    "--generator.num_blocks=256",
    # A generous deadline: these runs test the protocol end to end, not deadlines (the hang test
    # does); on a loaded machine a first session of openenv's echo app can take seconds.
    "--env.timeout_s=120",
    config=None,
    steps=2,
    max_new_tokens=None,
)


def _server_pids(mark: str) -> list[int]:
    """Live processes of local env servers started by the run marked `mark` (keepers and servers)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if b"titanrl.envs.openenv_server:contained_main" in cmdline and f"TITANRL_TEST_MARK={mark}".encode() in environ:
            pids.append(int(pid))
    return pids


def _run_cmd(folder, extra=()) -> list[str]:
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_calculator_server.toml")
    return [sys.executable, "-m", "titanrl.cli", "run", config, f"--job.dump_folder={folder}", *SMALL, *extra]


@pytest.mark.slow  # ~40 s on 2 cores; test_sigkill_of_the_run_leaves_no_server covers the launch in CI
def test_titanrl_run_trains_through_a_local_server_and_stops_it(tmp_path):
    mark = f"run-{os.getpid()}"
    proc = run_cmd(_run_cmd(tmp_path), {**ENV, "TITANRL_TEST_MARK": mark}, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "reward_mean" in r]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["env_failures"] == 0 and m["env_turns"] >= 1.0 for m in steps), steps
    assert _server_pids(mark) == []


def test_sigkill_of_the_run_leaves_no_server(tmp_path):
    """SIGKILL of `titanrl run`'s process group while local environment servers run -> no server process left alive."""
    mark = f"kill-{os.getpid()}"
    cmd = _run_cmd(tmp_path, ["--training.steps=50"])
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            cmd, env={**ENV, "TITANRL_TEST_MARK": mark}, stdout=out, stderr=out, start_new_session=True
        )
    deadline = time.monotonic() + 300
    while not _server_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _server_pids(mark), (tmp_path / "out.txt").read_text()[-3000:]
    time.sleep(3.0)  # the server is up (its keeper forked it) and the run connected to it
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while _server_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _server_pids(mark) == []


@pytest.mark.slow  # ~40-90 s on 2 cores
def test_titanrl_run_trains_against_openenv_echo_server(tmp_path, servers):
    """openenv-core's echo environment (never done; reward 0.1 per character) behind [env] urls:
    episodes end at max_turns, every step's reward is the echo's, none fails."""
    extra = [
        "--env.servers=0",
        f'--env.urls=["{servers["echo"]}"]',
        "--env.action_field=message",
        "--env.observation_field=echoed_message",
        "--env.max_turns=2",
    ]
    proc = run_cmd(_run_cmd(tmp_path, extra), ENV, timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "reward_mean" in r]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # Most episodes take both turns (one whose echo would pass max_total_tokens ends after the first).
        assert m["env_failures"] == 0 and 1.5 <= m["env_turns"] <= 2.0 and m["reward_mean"] > 0.5, m

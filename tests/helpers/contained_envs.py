"""Environments that start processes or hold memory, for the containment tests of environment
workers (tests/test_envs.py), and the helpers that find what they started. Each started process
is a `sleep 300` whose pid is appended to $TITANRL_TEST_PID_DIR/<worker pid>.pids, one
'kind pid' a line (as tests/helpers/contained_fns.py does for reward functions)."""

import os
import signal
import subprocess
import time

from helpers.contained_fns import _double_fork, _record
from titanrl.envs.base import Environment

_HOARD: list[bytes] = []


class SpawningEnv(Environment):
    """reset() leaves a plain child, a `setsid` child and a double-forked daemon; step('exit')
    ends its worker, step('hang') hangs, any other step ends the episode."""

    def reset(self, sample):
        _record("plain", subprocess.Popen(["sleep", "300"]).pid)
        _record("setsid", subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
        _record("daemon", _double_fork())
        return sample["prompt"]

    def step(self, model_text):
        if model_text == "exit":
            os._exit(3)
        if model_text == "hang":
            time.sleep(3600)
        return "", 1.0, True, {}


class LeakyEnv(Environment):
    """Each step keeps int(model_text) MB more, in the worker, past the episode's end."""

    def reset(self, sample):
        return sample["prompt"]

    def step(self, model_text):
        _HOARD.append(b"x" * (int(model_text) << 20))
        return "", 1.0, True, {}


class TreeHogEnv(Environment):
    """step('<mb> <child_mb>'): a child holds child_mb MB while the worker takes mb MB (each
    under the worker's address-space limit, the two together over its cgroup's memory limit)."""

    def reset(self, sample):
        return sample["prompt"]

    def step(self, model_text):
        mb, child_mb = (int(n) for n in model_text.split())
        child = os.fork()
        if child == 0:
            held = b"y" * (child_mb << 20)  # noqa: F841 - held until killed
            time.sleep(300)
            os._exit(0)
        time.sleep(1.0)  # the child's memory is in place
        try:
            held = b"z" * (mb << 20)  # noqa: F841
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        return "", 1.0, True, {}


def spawned(pid_dir: str) -> list[int]:
    """Pids of every process the environments recorded in `pid_dir`."""
    pids = []
    for name in os.listdir(pid_dir):
        with open(os.path.join(pid_dir, name)) as f:
            pids += [int(line.split()[1]) for line in f]
    return pids


def sleep_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return "(sleep)" in stat and stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def alive_when_settled(pid_dir: str, expected: int, timeout_s: float = 10.0) -> int:
    """How many recorded processes are alive, waiting up to `timeout_s` for it to be `expected`
    (a daemon may still be between its fork and its exec; a killed one a moment from gone)."""
    end = time.monotonic() + timeout_s
    while sum(map(sleep_alive, spawned(pid_dir))) != expected and time.monotonic() < end:
        time.sleep(0.05)
    return sum(map(sleep_alive, spawned(pid_dir)))


def kill_leftovers(pid_dir: str) -> None:
    for pid in spawned(pid_dir) if os.path.isdir(pid_dir) else []:
        if sleep_alive(pid):
            os.kill(pid, signal.SIGKILL)

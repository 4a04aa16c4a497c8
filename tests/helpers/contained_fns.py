"""Reward functions that start processes or hold memory, for the containment tests
(tests/test_reward_isolation.py, tests/test_launch_hygiene.py). Each started process is a
`sleep 300` whose pid is appended to $TITANRL_TEST_PID_DIR/<worker pid>.pids, one 'kind pid' a line."""

import os
import signal
import subprocess
import time

_HOARD: list[bytes] = []


def _record(kind: str, pid: int) -> None:
    with open(os.path.join(os.environ["TITANRL_TEST_PID_DIR"], f"{os.getpid()}.pids"), "a") as f:
        f.write(f"{kind} {pid}\n")


def _double_fork() -> int:
    """A daemon the classic way: fork, setsid, fork again, the middle process exits."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(r)
        os.setsid()
        daemon = os.fork()
        if daemon == 0:
            os.execvp("sleep", ["sleep", "300"])
        os.write(w, str(daemon).encode())
        os._exit(0)
    os.close(w)
    daemon = int(os.read(r, 32))
    os.close(r)
    os.waitpid(middle, 0)
    return daemon


def spawns(prompt: str, completion: str, metadata: dict) -> float:
    """Leave behind a plain child, a `setsid` child and a double-forked daemon per call."""
    _record("plain", subprocess.Popen(["sleep", "300"]).pid)
    _record("setsid", subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
    _record("daemon", _double_fork())
    return 1.0


def leaks(prompt: str, completion: str, metadata: dict) -> float:
    """Keep metadata['mb'] MB more on every call (written, so resident)."""
    _HOARD.append(b"x" * (metadata["mb"] << 20))
    return 1.0


def tree_hog(prompt: str, completion: str, metadata: dict) -> float:
    """A child holds metadata['child_mb'] MB while the worker itself takes metadata['mb'] MB:
    each alone is under the worker's limit, the two together are not."""
    child = os.fork()
    if child == 0:
        held = b"y" * (metadata["child_mb"] << 20)  # noqa: F841 - held until killed
        time.sleep(300)
        os._exit(0)
    time.sleep(1.0)  # the child's memory is in place
    try:
        held = b"z" * (metadata["mb"] << 20)  # noqa: F841
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    return 1.0

"""User reward functions for tests: importable as 'helpers.reward_fns:<name>' with tests/ on PYTHONPATH."""

import math
import time


def flaky(prompt: str, completion: str, metadata: dict):
    """Raises, hangs or returns NaN on some samples, a sane reward on the others."""
    h = sum(map(ord, completion)) % 5
    if h == 0:
        raise RuntimeError("user reward bug")
    if h == 1:
        return math.nan
    if h == 2 and len(completion) % 7 == 0:
        time.sleep(30)
    return {"reward": float(len(completion) % 3), "correct": False}


def raises_system_exit(prompt: str, completion: str, metadata: dict):
    """`raise SystemExit` on every sample, as reward code lifted from a script might (`sys.exit()`)."""
    raise SystemExit


def exits_process(prompt: str, completion: str, metadata: dict):
    """Ends its worker process on every sample (os._exit skips every handler)."""
    import os

    os._exit(7)


def hangs(prompt: str, completion: str, metadata: dict):
    """Never returns on completions 'hang'; 1.0 at once on the others."""
    if completion == "hang":
        time.sleep(3600)
    return 1.0


def length(prompt: str, completion: str, metadata: dict):
    """A fast, well-behaved reward: the completion's length."""
    return float(len(completion))


def misbehaves(prompt: str, completion: str, metadata: dict):
    """Does what the completion says, to its own worker process; 1.0 on 'ok'.

    'system_exit' / 'keyboard_interrupt' / 'generator_exit' raise them; 'exit' calls os._exit;
    'segfault' reads address 0; 'sigkill' kills its own process; 'memory' allocates 1 GiB;
    'print' writes metadata['bytes'] bytes to stdout and stderr, half through Python, half from a
    child process; 'fork' forks metadata['children'] sleeping processes (each forking one more),
    writes its process group and their pids to metadata['pid_file'], then exits its worker, or
    returns 1.0 if metadata['then'] == 'return'; 'hang' sleeps.
    """
    import os
    import signal
    import sys

    if completion == "system_exit":
        sys.exit(3)
    if completion == "keyboard_interrupt":
        raise KeyboardInterrupt
    if completion == "generator_exit":
        raise GeneratorExit
    if completion == "exit":
        os._exit(7)
    if completion == "segfault":
        import ctypes

        ctypes.string_at(0)
    if completion == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion == "memory":
        return float(len(bytearray(2**30)))
    if completion == "print":
        import subprocess

        half = metadata["bytes"] // 2
        sys.stdout.write("p" * (half // 2))
        sys.stderr.write("e" * (half - half // 2))
        subprocess.run([sys.executable, "-c", f"import os; os.write(1, b'c' * {metadata['bytes'] - half})"], check=True)
        return 1.0
    if completion == "fork":
        pids = []
        for _ in range(metadata["children"]):
            pid = os.fork()
            if pid == 0:  # the child: one grandchild, then both sleep until killed
                try:
                    os.fork()
                    time.sleep(3600)
                finally:
                    os._exit(0)
            pids.append(pid)
        with open(metadata["pid_file"], "w") as f:
            f.write(" ".join(map(str, [os.getpgrp(), *pids])))
        if metadata.get("then") == "return":
            return 1.0
        os._exit(1)
    if completion == "hang":
        time.sleep(3600)
    return 1.0


def coin(prompt: str, completion: str, metadata: dict):
    """Correct on about half of the completions, by a hash of the text: varied pass@k from an
    untrained model (evaluation suites' tests)."""
    import zlib

    correct = zlib.crc32(completion.encode()) % 2 == 0
    return {"reward": float(correct), "correct": correct}

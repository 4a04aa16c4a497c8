"""User reward functions for tests: importable as 'reward_fns:<name>' with tests/ on PYTHONPATH."""

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

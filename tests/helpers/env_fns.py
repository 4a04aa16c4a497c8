"""Environments for tests/test_envs.py (imported by name in the env worker processes)."""

import time

from titanrl.envs.base import Environment


class EchoEnv(Environment):
    """Answers every turn with '<result>ok</result>' and ends after `turns` steps with reward 1."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        return sample["prompt"]

    def step(self, model_text):
        self.seen += 1
        if self.seen >= self.turns:
            return "", 1.0, True, {"correct": True}
        return "<result>ok</result>", 0.25, False, {}


class FaultyEnv(Environment):
    """Behaves like EchoEnv(2) except for samples whose metadata says 'raise', 'hang' or 'garbage'."""

    def __init__(self) -> None:
        self.mode, self.seen = "", 0

    def reset(self, sample):
        self.mode = sample.get("metadata", {}).get("fault", "")
        if self.mode == "reset_raise":
            raise RuntimeError("boom at reset")
        return sample["prompt"]

    def step(self, model_text):
        self.seen += 1
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "hang":
            time.sleep(3600)
        if self.mode == "garbage":
            return 42
        if self.mode == "nan":
            return "x", float("nan"), False, {}
        if self.seen >= 2:
            return "", 1.0, True, {}
        return "<result>ok</result>", 0.0, False, {}

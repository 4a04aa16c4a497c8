"""Embedded tasks with verifiable rewards: no downloads, a generator of prompts, a verifier.

Each task makes `Sample`s (prompt text, reference answer, and a worked solution used by the SFT
warm-up) from a seeded RNG; train and eval splits use disjoint seeds. Rewards: `correct` (1 if
the extracted answer is right) plus `format_weight` if the completion is well-formed at all.

`Sample`, `Score`, `Task` and `safe_arithmetic` live in `titanrl/data/task_types.py` (re-exported
here). The tasks of the multi-turn environments live with them (`titanrl/envs/builtin.py`);
`titanrl.envs.builtin.ALL_TASKS` is this registry and theirs.
"""

import difflib
import random
import re
from collections.abc import Callable

from titanrl.data.key_value import KeyValueRetrieval
from titanrl.data.short_answer import ShortAnswer
from titanrl.data.task_types import Sample, Score, Task, safe_arithmetic
from titanrl.data.word_problems import ToolMultiply

__all__ = [
    "Arithmetic",
    "Countdown",
    "NumericMath",
    "Reverse",
    "Sample",
    "Score",
    "ShortAnswer",
    "Sort",
    "TASKS",
    "Task",
    "ToolMultiply",
    "build_task",
    "safe_arithmetic",
]


_INT = re.compile(r"\s*(-?\d+)\s*$")


class Arithmetic(Task):
    """'23+45=' -> '68'. Operands up to `max_digits` digits; `ops` from '+', '-', '*'."""

    name = "arithmetic"

    def __init__(self, max_digits: int = 2, ops: str = "+") -> None:
        self.max_digits = max_digits
        self.ops = ops

    def make(self, rng: random.Random) -> Sample:
        hi = 10**self.max_digits - 1
        a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Sample(prompt=f"{a}{op}{b}=", answer=str(value), solution=str(value))

    def extract(self, completion: str) -> str | None:
        m = _INT.match(completion)
        return str(int(m.group(1))) if m else None


class Reverse(Task):
    """'rev:abcd=' -> 'dcba' (sorting's simpler sibling: a pure copy-permutation task)."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6) -> None:
        self.min_len, self.max_len = min_len, max_len

    def make(self, rng: random.Random) -> Sample:
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(self.min_len, self.max_len)))
        return Sample(prompt=f"rev:{word}=", answer=word[::-1], solution=word[::-1])

    def extract(self, completion: str) -> str | None:
        text = completion.strip()
        return text if text.isalpha() else None


class Sort(Task):
    """'sort:3,1,2=' -> '1,2,3'."""

    name = "sort"

    def __init__(self, min_len: int = 3, max_len: int = 5) -> None:
        self.min_len, self.max_len = min_len, max_len

    def make(self, rng: random.Random) -> Sample:
        nums = [rng.randint(0, 9) for _ in range(rng.randint(self.min_len, self.max_len))]
        answer = ",".join(map(str, sorted(nums)))
        return Sample(prompt=f"sort:{','.join(map(str, nums))}=", answer=answer, solution=answer)

    def extract(self, completion: str) -> str | None:
        text = completion.strip()
        return text if re.fullmatch(r"\d(,\d)*", text) else None


# ---- countdown: reach a target with the given numbers, checked without eval() ----


class Countdown(Task):
    """'cd:3,5,7->22=' -> an expression using each given number at most once, equal to 22."""

    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 9) -> None:
        self.num_numbers, self.max_number = num_numbers, max_number

    def make(self, rng: random.Random) -> Sample:
        nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        # Build a solvable target from a random expression over the numbers.
        a, b, c = (nums + [1, 1])[:3]
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        solution = f"({a}{op1}{b}){op2}{c}" if self.num_numbers >= 3 else f"{a}{op1}{b}"
        target, _ = safe_arithmetic(solution)
        return Sample(
            prompt=f"cd:{','.join(map(str, nums))}->{int(target)}=",
            answer=str(int(target)),
            solution=solution,
            metadata={"numbers": nums, "target": int(target)},
        )

    def extract(self, completion: str) -> str | None:
        text = completion.strip()
        return text if text and re.fullmatch(r"[\d+\-*/() ]+", text) else None

    def is_correct(self, extracted: str, sample_answer: str, metadata: dict) -> bool:
        try:
            value, used = safe_arithmetic(extracted)
        except (ValueError, SyntaxError, RecursionError):
            return False
        available = list(metadata["numbers"])
        for n in used:
            if n not in available:
                return False
            available.remove(n)
        return abs(value - metadata["target"]) < 1e-9


TASKS: dict[str, Callable[[], Task]] = {
    "arithmetic": Arithmetic,
    "arithmetic_mul": lambda: Arithmetic(max_digits=2, ops="+-*"),
    "reverse": Reverse,
    "sort": Sort,
    "countdown": Countdown,
    "short_answer": ShortAnswer,
    "kv_retrieval": KeyValueRetrieval,
    "kv_retrieval_long": lambda: KeyValueRetrieval(num_keys=48),
    "tool_multiply": ToolMultiply,
}


def build_task(name: str, tasks: dict[str, Callable[[], Task]] = TASKS) -> Task:
    """The task registered as `name` in `tasks`; an unknown name lists the registered ones."""
    if name not in tasks:
        close = difflib.get_close_matches(name, list(tasks), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(
            f"Unknown task '{name}'; embedded tasks: {', '.join(tasks)} (or data.path for your own file).{hint}"
        )
    return tasks[name]()


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class NumericMath(Task):
    """GSM8K-style verifier for users' data: the answer is the number after '####' if present,
    else the last number in the completion; compared numerically (commas ignored)."""

    name = "numeric_math"

    def extract(self, completion: str) -> str | None:
        tail = completion.split("####")[-1]
        numbers = _NUMBER.findall(tail)
        return numbers[-1].replace(",", "") if numbers else None

    def is_correct(self, extracted: str, sample_answer: str, metadata: dict) -> bool:
        try:
            return abs(float(extracted) - float(sample_answer.replace(",", ""))) < 1e-6
        except ValueError:
            return False

"""Base types of the embedded tasks, shared by the task registry (`titanrl/data/tasks.py`) and
the built-in multi-turn environments (`titanrl/envs/builtin.py`), which both import it and not
each other's counterpart: `Sample`, `Score`, `Task`, and `safe_arithmetic` (the expression
evaluator used by the countdown task and the calculator tool).
"""

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sample:
    prompt: str
    answer: str
    solution: str
    """A correct completion (what SFT warm-up trains on); ends with the answer."""
    metadata: dict = field(default_factory=dict)


@dataclass
class Score:
    reward: float
    correct: bool
    well_formed: bool


class Task:
    name: str = ""
    format_weight: float = 0.1

    def make(self, rng: random.Random) -> Sample:
        raise NotImplementedError

    def extract(self, completion: str) -> str | None:
        """The answer part of a completion, or None if it is malformed."""
        raise NotImplementedError

    def is_correct(self, extracted: str, sample_answer: str, metadata: dict) -> bool:
        return extracted == sample_answer

    def score(self, completion: str, answer: str, metadata: dict) -> Score:
        extracted = self.extract(completion)
        if extracted is None:
            return Score(0.0, False, False)
        correct = self.is_correct(extracted, answer, metadata)
        return Score(float(correct) + self.format_weight, correct, True)

    def samples(self, split: str, n: int, seed: int) -> list[Sample]:
        # Disjoint seed streams keep eval prompts out of training (up to chance collisions).
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return [self.make(rng) for _ in range(n)]


# ---- arithmetic expressions, checked without eval() ----

_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def safe_arithmetic(expression: str, max_len: int = 64) -> tuple[float, list[int]]:
    """Value of an expression of integers, + - * / and parentheses, and the integers it uses.

    Parses with `ast` and walks only those node types: never `eval`. Raises ValueError otherwise.
    """
    if len(expression) > max_len:
        raise ValueError("expression too long")
    tree = ast.parse(expression, mode="eval")
    numbers: list[int] = []

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return node.value
        raise ValueError(f"not allowed in an expression: {type(node).__name__}")

    return walk(tree.body), numbers

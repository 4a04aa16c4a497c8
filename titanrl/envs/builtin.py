"""Built-in multi-turn environments (no network), with tasks that generate their prompts.

- `calculator`: arithmetic word problems; `<tool>23*47</tool>` returns `<result>1081</result>`
  (evaluated by `safe_arithmetic`, never `eval`); the final answer ends the episode.
- `python`: a restricted Python-expression sandbox tool, each call in a fresh subprocess with a
  time limit, an address-space limit, no imports and no dunder access.
- `guess_number`: guess a secret in [1, 16] with higher/lower feedback.

Each env's task (`ENV_TASKS`) yields samples whose metadata holds a demonstration episode,
`demo = [[text, from_model], ...]`, for the supervised warm-up (environment text masked).
`ALL_TASKS` is the registry of every embedded task: `titanrl/data/tasks.py`'s and these.

The calculator and the Python sandbox also read tool calls in a chat template's format
(`tool_format='hermes'` or 'llama3', env.tool_format), their tool described in `tools`: then
every call of a turn is answered (`titanrl/envs/tool_calls.py: tool_step`), a malformed one with an
error result, and a turn without a call is the final answer. The tag format stays the default.
"""

import ast
import random
import subprocess
import sys
from typing import Any

from titanrl.data.task_types import Sample, Task, safe_arithmetic
from titanrl.data.tasks import TASKS
from titanrl.envs.base import RESULT_CLOSE, RESULT_OPEN, TOOL_CLOSE, TOOL_OPEN, Environment, last_int, parse_tool_call
from titanrl.envs.tool_calls import TOOL_FORMATS, ToolCall, tool_name, tool_step

_FORMATS = tuple(f for f in TOOL_FORMATS if f != "auto")


def function_tool(name: str, description: str, argument: str, argument_description: str) -> dict:
    """The JSON schema of a tool with one required string argument."""
    properties = {argument: {"type": "string", "description": argument_description}}
    parameters = {"type": "object", "properties": properties, "required": [argument]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def string_argument(call: ToolCall, argument: str) -> str | None:
    """A tag call's text, or the named string argument of a JSON call (None if it has none)."""
    value = call.text if call.name is None else call.arguments.get(argument)
    return value if isinstance(value, str) else None


def check_tool_format(tool_format: str) -> str:
    if tool_format not in _FORMATS:
        raise ValueError(f"tool_format must be one of {_FORMATS}, got {tool_format!r}")
    return tool_format


# ---- calculator ----

_TEMPLATES = [
    "{a} boxes of {b} pens. pens?",
    "{a} rows of {b} seats. seats?",
    "{a} bags with {b} coins. coins?",
]


class ToolEnv(Environment):
    """An environment with one tool (`tools[0]`), which the model calls in `tool_format`; a turn
    without a call is its final answer, right when `task().extract` of it is the sample's answer.
    Subclasses set `tools`, `argument` (the tool's string argument) and `task`, and define `use`."""

    tool_formats = _FORMATS
    argument: str
    task: type[Task]
    tool_format: str
    answer: str

    def use(self, text: str) -> str:
        """The tool's result for its argument `text`."""
        raise NotImplementedError

    def reset(self, sample: dict) -> str:
        self.answer = str(sample["answer"])
        return sample["prompt"]

    def step(self, model_text: str) -> tuple[str, float, bool, dict]:
        if self.tool_format != "tag":
            answered = tool_step(model_text, self.tool_format, self.tools, self.call)
            return answered if answered is not None else self.final(model_text)
        text = parse_tool_call(model_text)
        if text is None:
            return self.final(model_text)
        return f"{RESULT_OPEN}{self.use(text)}{RESULT_CLOSE}", 0.0, False, {"tool_call": True}

    def final(self, model_text: str) -> tuple[str, float, bool, dict]:
        correct = self.task().extract(model_text) == self.answer
        return "", 1.0 if correct else 0.0, True, {"correct": correct}

    def call(self, call: ToolCall) -> str:
        text = string_argument(call, self.argument)
        if text is None:
            return f"error: {tool_name(self.tools[0])} takes a string argument '{self.argument}'"
        return self.use(text)


class CalculatorTask(Task):
    """'4 boxes of 37 pens. pens?' -> <tool>4*37</tool><result>148</result>148."""

    name = "calculator"

    def make(self, rng: random.Random) -> Sample:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        prompt = rng.choice(_TEMPLATES).format(a=a, b=b) + " "
        answer = str(a * b)
        call = f"{TOOL_OPEN}{a}*{b}{TOOL_CLOSE}"
        result = f"{RESULT_OPEN}{answer}{RESULT_CLOSE}"
        demo = [[call, True], [result, False], [answer, True]]
        return Sample(prompt=prompt, answer=answer, solution=call + result + answer, metadata={"demo": demo})

    def extract(self, completion: str) -> str | None:
        tail = completion.rsplit(RESULT_CLOSE, 1)[-1].strip()
        return tail if tail.lstrip("-").isdigit() else None


CALCULATOR_TOOL = function_tool(
    "calculator", "Evaluate an arithmetic expression of numbers, + - * / and parentheses.", "expression", "e.g. 23*47"
)


class CalculatorEnv(ToolEnv):
    tools = (CALCULATOR_TOOL,)
    argument = "expression"
    task = CalculatorTask

    def __init__(self, max_expression_len: int = 64, tool_format: str = "tag") -> None:
        self.max_expression_len = max_expression_len
        self.tool_format = check_tool_format(tool_format)
        self.answer = ""

    def use(self, text: str) -> str:
        try:
            value, _ = safe_arithmetic(text, self.max_expression_len)
            return str(int(value)) if value == int(value) else f"{value:.6g}"
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError):
            return "error"  # the model's malformed call: the tool says so, the episode goes on


# ---- python sandbox ----

_SANDBOX_BUILTINS = [
    "abs",
    "all",
    "any",
    "bool",
    "divmod",
    "int",
    "len",
    "list",
    "max",
    "min",
    "pow",
    "range",
    "reversed",
    "round",
    "sorted",
    "str",
    "sum",
    "tuple",
    "zip",
]
_SANDBOX_RUNNER = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({mem}, {mem}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
allowed = {{name: __builtins__.__dict__[name] if hasattr(__builtins__, "__dict__") else __builtins__[name]
           for name in {builtins!r}}}
code = sys.stdin.read()
try:
    print(repr(eval(compile(code, "<tool>", "eval"), {{"__builtins__": allowed}}, {{}}))[:{max_out}])
except MemoryError:
    print("error: memory limit")
except Exception as e:
    print("error: " + type(e).__name__)
"""


def check_sandbox_expression(expression: str) -> None:
    """Reject what the sandbox never runs: statements, imports, attribute access to dunder
    names, lambdas. Raises ValueError naming the construct."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"syntax error: {e.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Lambda, ast.NamedExpr)):
            raise ValueError(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.Attribute):
            raise ValueError("attribute access is not allowed")
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise ValueError(f"name '{node.id}' is not allowed")


def run_sandboxed(
    expression: str, timeout_s: float = 2.0, memory_mb: int = 256, max_out: int = 200, preexec_fn=None
) -> str:
    """Evaluate a Python expression in a fresh, isolated interpreter (-I -S) with CPU-time and
    address-space limits and only a few safe builtins; the result's repr or 'error: ...'.
    `preexec_fn` jails the child further (`titanrl/envs/openenv_server.py`: no network, user nobody)."""
    try:
        check_sandbox_expression(expression)
    except ValueError as e:
        return f"error: {e}"
    runner = _SANDBOX_RUNNER.format(
        mem=memory_mb * 2**20, cpu=max(1, int(timeout_s)), builtins=_SANDBOX_BUILTINS, max_out=max_out
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", runner],
            input=expression,
            capture_output=True,
            text=True,
            timeout=timeout_s + 1.0,
            preexec_fn=preexec_fn,
        )
    except subprocess.TimeoutExpired:
        return "error: timeout"
    if proc.returncode != 0:
        return "error: killed" if proc.returncode < 0 else "error: failed"
    return proc.stdout.strip()[:max_out]


class PythonTask(Task):
    """'sum of squares 1..7?' -> <tool>sum(i*i for i in range(1, 8))</tool><result>140</result>140."""

    name = "python"

    def make(self, rng: random.Random) -> Sample:
        n = rng.randint(3, 30)
        kind = rng.choice(["squares", "cubes"])
        power = 2 if kind == "squares" else 3
        prompt = f"sum of {kind} 1..{n}? "
        answer = str(sum(i**power for i in range(1, n + 1)))
        call = f"{TOOL_OPEN}sum(i**{power} for i in range(1, {n + 1})){TOOL_CLOSE}"
        result = f"{RESULT_OPEN}{answer}{RESULT_CLOSE}"
        return Sample(
            prompt=prompt,
            answer=answer,
            solution=call + result + answer,
            metadata={"demo": [[call, True], [result, False], [answer, True]]},
        )

    def extract(self, completion: str) -> str | None:
        return CalculatorTask().extract(completion)


PYTHON_TOOL = function_tool(
    "python", "Evaluate one Python expression (a few builtins, no imports) and return its repr.", "code", "e.g. 2**10"
)


class PythonSandboxEnv(ToolEnv):
    tools = (PYTHON_TOOL,)
    argument = "code"
    task = PythonTask
    preexec_fn = None
    """Run in each sandbox child before the code (a served sandbox's jail)."""

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256, tool_format: str = "tag") -> None:
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.tool_format = check_tool_format(tool_format)
        self.answer = ""

    def use(self, text: str) -> str:
        return run_sandboxed(text, self.timeout_s, self.memory_mb, preexec_fn=self.preexec_fn)


# ---- guess the number ----


class GuessNumberTask(Task):
    """'guess 1-16: ' with the secret in metadata; the demo is a binary search."""

    name = "guess_number"

    def make(self, rng: random.Random) -> Sample:
        secret = rng.randint(1, 16)
        demo: list[list[Any]] = []  # [text, the model wrote it] pairs, JSON lists in the metadata
        low, high = 1, 16
        while True:
            guess = (low + high) // 2
            demo.append([f"{TOOL_OPEN}{guess}{TOOL_CLOSE}", True])
            if guess == secret:
                demo.append([f"{RESULT_OPEN}correct{RESULT_CLOSE}", False])
                break
            hint = "higher" if secret > guess else "lower"
            demo.append([f"{RESULT_OPEN}{hint}{RESULT_CLOSE}", False])
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
        return Sample(
            prompt="guess 1-16: ", answer=str(secret), solution="".join(t for t, _ in demo), metadata={"demo": demo}
        )

    def extract(self, completion: str) -> str | None:
        guess = last_int(completion)
        return None if guess is None else str(guess)


class GuessNumberEnv(Environment):
    def __init__(self, wrong_guess_reward: float = 0.0) -> None:
        self.secret = 0
        self.wrong_guess_reward = wrong_guess_reward

    def reset(self, sample: dict) -> str:
        self.secret = int(sample["answer"])
        return sample["prompt"]

    def step(self, model_text: str) -> tuple[str, float, bool, dict]:
        call = parse_tool_call(model_text)
        guess = last_int(call if call is not None else model_text)
        if guess is None:
            return "", 0.0, True, {"correct": False, "error": "no guess"}
        if guess == self.secret:
            return f"{RESULT_OPEN}correct{RESULT_CLOSE}", 1.0, True, {"correct": True}
        hint = "higher" if self.secret > guess else "lower"
        return f"{RESULT_OPEN}{hint}{RESULT_CLOSE}", self.wrong_guess_reward, False, {"correct": False}


ENVS = {"calculator": CalculatorEnv, "python": PythonSandboxEnv, "guess_number": GuessNumberEnv}
ENV_TASKS = {"calculator": CalculatorTask, "python": PythonTask, "guess_number": GuessNumberTask}
ALL_TASKS = {**TASKS, **ENV_TASKS}
"""Every embedded task by name: the single-turn ones (`titanrl/data/tasks.py`) and the
multi-turn environments' tasks."""

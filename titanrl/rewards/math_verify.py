"""Math-answer verifier for RL rewards (GSM8K / MATH style); model text is never `eval`-ed.

Use: `--data.path=math.jsonl --reward.function=titanrl.rewards.math_verify:math_verifier`
(rows {"prompt", "answer"}). `math_verifier = MathVerifier()` is a `Task`: the reward workers call
its `score(completion, answer, metadata)` with the row's answer (reward 1.0 if correct, else 0.0).
Also `gsm8k_verifier`, `boxed_verifier`, your own `MathVerifier(mode=..., format_weight=...)` in
your module, and `math_reward(prompt, completion, metadata)` (reference: metadata["answer"] or
["ground_truth"], e.g. a JSONL column). A reference with \\boxed{} or '####' has its answer extracted.

Extraction, strategies in MODES[mode] order: boxed (last top-level \\boxed{} / \\fbox{}, braces
  matched, a box in a box is content, an unclosed box ignored), gsm8k (line after the last '####'),
  answer_is (after the last "answer is" / "answer:", to the end of line or sentence), last_number.
  auto: all four; gsm8k: gsm8k first; strict: no last_number; boxed; last_number.
Normalisation: drops $ \\left \\right \\! \\, \\; \\quad ^\\circ °, inner \\boxed, units (\\text{} after a
  value, or a word after a number: 3+ letters or cm mm km kg mg ml ft yd lb oz mi hr in sq; "5x"
  stays), a leading "x =" / "x \\in", spaces; \\dfrac \\tfrac \\frac12 \\sqrt2 -> \\frac{1}{2} \\sqrt{2};
  "1,000" -> 1000 only if the whole answer is that number ("(1,2)" stays a tuple); 5.00 -> 5.
Percentages: the sign (%, \\%, "percent") is dropped ("50\\%" equals "50"); if exactly one side had
  it, its value / 100 also matches ("50\\%" equals "0.5"); bare numbers never rescale (0.5 != 50).
Equivalence: equal strings, else by structure: unions, tuples, intervals (brackets must agree) in
  order, sets \\{a,b\\} and bare lists "a, b" as multisets. Scalars: case-insensitive strings; math
  (`latex_to_expr`: \\frac \\sqrt \\pi \\infty \\cdot \\times ^ sin cos tan log ln exp, Greek, implicit
  products; a word is a product of letters) numerically if constant (rel 1e-6, abs 1e-9), else by
  sympy `simplify(a - b) == 0` (extra `math`), or without sympy at three points of the variables.
Safety: answers over 400 characters, completions over `max_chars`, 200+ tokens, powers with
  |exponent| > 1000 or 1000+ digits are not equal, refused before anything is built; a SIGALRM
  limit (`timeout_s`) guards each comparison in a main thread (as in reward workers) with no
  other timer; the reward runner's per-sample timeout is the last resort.
"""

import ast
import cmath
import importlib
import importlib.util
import math
import operator
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from titanrl.data.task_types import Task

MAX_ANSWER_CHARS, MAX_TOKENS, MAX_EXPONENT, MAX_DIGITS = 400, 200, 1000.0, 1000.0
REL_TOL, ABS_TOL = 1e-6, 1e-9


class _GiveUp(BaseException):
    """Too large or out of time: not equal (no `except Exception` inside sympy swallows it)."""


def _sympy() -> Any:
    return importlib.import_module("sympy") if importlib.util.find_spec("sympy") else None


def _raise_timeout(signum: int, frame: object) -> None:
    raise _GiveUp()


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    if not (
        seconds > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    ):
        yield
        return
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    # Re-fire every 50 ms after the deadline: sympy code that catches Exception can swallow the first.
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- extraction ----

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_SPACE = re.compile(r"\\boxed +([^\s${}]+)")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"(?i)\banswer\s*(?:is|:)\s*:?\s*")
_NUMBER = re.compile(r"-?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _match(s: str, i: int) -> int | None:
    """Index of the brace that closes the '{' at s[i] (escaped braces skipped), or None."""
    depth = 0
    while i < len(s):
        depth += (s[i] == "{") - (s[i] == "}")
        if depth == 0:
            return i
        i += 2 if s[i] == "\\" else 1
    return None


def _boxed(text: str) -> str | None:
    """Content of the last top-level \\boxed{...} / \\fbox{...}: one pass over the text."""
    opens = {m.end() - 1: m.end() for m in _BOX_OPEN.finditer(text)}  # brace index -> content start
    best: tuple[int, str] | None = None  # (closing index, content): the last box to close is top-level
    stack: list[int] = []
    i = min(opens, default=len(text))
    while i < len(text):
        if text[i] == "{":
            stack.append(i)
        elif text[i] == "}" and stack and (j := stack.pop()) in opens:
            best = (i, text[opens[j] : i])
        i += 2 if text[i] == "\\" else 1
    spaced = [(m.start(), m.group(1)) for m in _BOX_SPACE.finditer(text)][-1:]  # "\\boxed 5"
    return max(spaced + ([best] if best else []), default=(0, None))[1]


def _answer_is(text: str) -> str | None:
    found = list(_ANSWER_IS.finditer(text))
    rest = text[found[-1].end() :].split("\n", 1)[0] if found else ""
    return re.split(r"\.(?=\s|$)", rest, maxsplit=1)[0].strip(" *$") or None


_STRATEGIES: dict[str, Callable[[str], str | None]] = {
    "boxed": _boxed,
    "gsm8k": lambda t: (_HASH.findall(t) or [None])[-1],
    "answer_is": _answer_is,
    "last_number": lambda t: (_NUMBER.findall(t) or [None])[-1],
}
MODES: dict[str, tuple[str, ...]] = {
    "auto": ("boxed", "gsm8k", "answer_is", "last_number"),
    "gsm8k": ("gsm8k", "boxed", "answer_is", "last_number"),
    "strict": ("boxed", "gsm8k", "answer_is"),
    "boxed": ("boxed",),
    "last_number": ("last_number",),
}


def extract_answer(text: str, mode: str | tuple[str, ...] = "auto") -> str | None:
    """The final answer in `text` by the strategies of `mode` (a name in MODES, or a tuple of
    strategy names), or None if none finds one."""
    for name in MODES[mode] if isinstance(mode, str) else mode:
        if found := (_STRATEGIES[name](text) or "").strip():
            return found
    return None


def gold_answer(answer: object) -> str:
    """The reference answer: extracted if it is a whole solution (\\boxed or '####'), else as is."""
    text = str(answer)
    return (extract_answer(text, ("boxed", "gsm8k")) or text) if re.search(r"\\boxed|\\fbox|####", text) else text


# ---- normalisation ----

_DROP = re.compile(
    r"\\boxed|\\fbox|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\displaystyle|\\[!,;:> ()]|\\q?quad|\\\$|\$|~"
    r"|\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree"
)
_PERCENT = re.compile(r"\\?%|\s*\\(?:text|mbox|mathrm)\{\s*percent\s*\}|\s*\bpercent\b")
_TEXT = re.compile(r"\\(?:text|textrm|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}(\^\{?\d\}?)?")
_LHS = re.compile(r"\\?[A-Za-z]+(?:_\{?\w+\}?)?\s*(?:=|\\in(?![A-Za-z]))\s*")
_UNIT = re.compile(
    r"(.*[\d}])\s*(?:[A-Za-z]{3,}|cm|mm|km|kg|mg|ml|ft|yd|lb|oz|mi|hr|in|sq)(?:\s+[A-Za-z]+)*"
    r"(?:\s*\^\s*\{?\d\}?)?"
)
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SPACES = re.compile(r"(\\[A-Za-z]+) (?=[A-Za-z])|\s")
_REWRITES = [
    (re.compile(p), r)
    for p, r in [
        (r"\\[dt]frac", r"\\frac"),
        (r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}"),
        (r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{"),
        (r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}"),
        (r"\\sqrt\s*(\d)", r"\\sqrt{\1}"),
    ]
]


def _strip_lhs(s: str) -> str:
    m = _LHS.match(s)
    return s[m.end() :] if m and m.end() < len(s) and "=" not in s[m.end() :] else s


def normalize(answer: str) -> tuple[str, bool] | None:
    """(normalised answer, whether it was a percentage), or None if it is too long to check."""
    s = str(answer).strip()
    if len(s) > MAX_ANSWER_CHARS or not s:
        return None
    s = _DROP.sub("", s.replace("\u2212", "-").replace("{,}", ","))
    s, percents = _PERCENT.subn("", s)
    s = _TEXT.sub(
        lambda m: (
            ""
            if m.string[: m.start()].strip() and re.fullmatch(r"[A-Za-z ]+", m.group(1))
            else m.group(1).strip() + (m.group(2) or "")
        ),
        s,
    )  # a unit after a value goes, other text stays
    s = _strip_lhs(re.sub(r"\s+", " ", s).strip().rstrip(".").strip())
    s = m.group(1) if (m := _UNIT.fullmatch(s)) else s
    for pattern, repl in _REWRITES:
        s = pattern.sub(repl, s)
    s = s.replace(",", "") if _THOUSANDS.fullmatch(s) else s
    s = _SPACES.sub(lambda m: m.group(1) + " " if m.group(1) else "", s)
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", re.sub(r"(\d)\.0+(?![\d])", r"\1", s)).removeprefix("+")
    return (m.group(1) if (m := re.fullmatch(r"\(([A-Za-z])\)", s)) else s), percents > 0


# ---- LaTeX -> plain expression -> a Python `ast` walked by our own code; values ----

_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "theta", "mu", "phi", "omega", "sigma", "tau", "rho")
_FUNCS = ("sqrt", "sin", "cos", "tan", "log", "exp")
_NAMES = {
    "pi": "pi",
    "infty": "oo",
    "infinity": "oo",
    "cdot": "*",
    "times": "*",
    "div": "/",
    "ln": "log",
    **{f: f for f in _FUNCS + _GREEK},
}
_CMD = re.compile(r"\\([A-Za-z]+)")
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|([A-Za-z]+)|(\*\*|[-+*/^()]))")
_ALLOWED = (
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Name,
    ast.Call,
    ast.Load,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.Pow,
    ast.USub,
    ast.UAdd,
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _group(s: str, i: int) -> tuple[str, int]:
    """The argument of a command at s[i]: a {...} group, a command or one character."""
    while s[i : i + 1] == " ":
        i += 1
    j, m = _match(s, i) if s[i : i + 1] == "{" else i, _CMD.match(s, i)
    if i >= len(s) or j is None:
        return "@", len(s)  # a missing argument or unbalanced braces: not math
    return (s[i + 1 : j], j + 1) if j > i else (m.group(), m.end()) if m else (s[i], i + 1)


def latex_to_expr(s: str) -> str:
    """Normalised LaTeX as a plain expression (`\\frac{a}{b}` -> `((a)/(b))`, `\\sqrt[n]{a}` ->
    `((a)^(1/(n)))`, `\\pi` -> `pi`, braces -> parentheses); '@' marks what is not plain math."""
    out, i = [], 0
    while i < len(s):
        m = _CMD.match(s, i)
        name, i = (m.group(1), m.end()) if m else ("", i + 1)
        if not m:
            out.append({"{": "(", "}": ")", "\\": "@"}.get(s[i - 1], s[i - 1]))  # '@' (\\{ etc.): not math
        elif name == "frac":
            a, i = _group(s, i)
            b, i = _group(s, i)
            out.append(f"(({latex_to_expr(a)})/({latex_to_expr(b)}))")
        elif name == "sqrt" and s[i : i + 1] == "[" and (j := s.find("]", i)) > 0:
            index, (a, i) = s[i + 1 : j], _group(s, j + 1)
            out.append(f"(({latex_to_expr(a)})^(1/({latex_to_expr(index)})))")
        elif name == "sqrt":
            a, i = _group(s, i)
            out.append(f" sqrt({latex_to_expr(a)})")
        else:
            out.append(f" {_NAMES.get(name, '@')} ")
    return "".join(out)


def _parse(s: str) -> ast.expr | None:
    """The answer as a tree of numbers, variables, pi, oo, + - * / ** and calls of _FUNCS (implicit
    products made explicit) by `ast.parse` of our own tokens (never evaluated); None if not math."""
    expr, i = latex_to_expr(s).rstrip(), 0
    tokens: list[str] = []
    while i < len(expr):
        m, last = _TOKEN.match(expr, i), tokens[-1] if tokens else "+"
        if m and m.group(2) and len(m.group(2)) > 1 and m.group(2) not in _NAMES.values():
            expr = expr[: m.start(2)] + " ".join(m.group(2)) + expr[m.end() :]  # a word: "xy" is x y
            continue
        tok = m and (m.group(1) or m.group(2) or m.group(3))
        if not tok or (last in _FUNCS and tok != "("):
            return None  # not math, or a function without its argument
        assert m is not None  # tok is one of m's groups
        if (
            (last == ")" or last[0].isalnum() or last[0] == ".")
            and last not in _FUNCS
            and (tok == "(" or tok[0].isalnum() or tok[0] == ".")
        ):
            tokens.append("*")  # 2x, 2(3), 2 pi, (1)(2)
        tokens, i = tokens + ["**" if tok == "^" else tok], m.end()
    if len(tokens) > MAX_TOKENS:
        raise _GiveUp("too many tokens")
    try:
        tree = ast.parse(" ".join(tokens) or "@", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    ok = all(isinstance(n, _ALLOWED) and (not isinstance(n, ast.Call) or len(n.args) == 1) for n in ast.walk(tree))
    return tree if ok else None


def _value(node: ast.expr, env: dict[str, float], sp: Any = None) -> Any:
    """Value of a `_parse` tree: a complex float (nan: domain error, inf: overflow; _GiveUp for a
    power too large to compute exactly: sympy only sees trees that pass), or with `sp` a sympy one."""
    try:
        if isinstance(node, ast.Constant):
            assert isinstance(node.value, (int, float)), "_TOKEN's constants are numbers"
            return sp.Rational(str(node.value)) if sp else complex(node.value)
        if isinstance(node, ast.Name) and node.id in ("pi", "oo"):
            return getattr(sp, node.id) if sp else complex(math.pi if node.id == "pi" else math.inf)
        if isinstance(node, ast.Name):
            return sp.Symbol(node.id) if sp else complex(env[node.id])
        if isinstance(node, ast.UnaryOp):
            x = _value(node.operand, env, sp)
            return -x if isinstance(node.op, ast.USub) else x
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name), "_parse inserts '*' before a '(' that follows no function"
            return getattr(sp or cmath, node.func.id)(_value(node.args[0], env, sp))
        assert isinstance(node, ast.BinOp), "_ALLOWED's other expressions are handled above"
        a, b = _value(node.left, env, sp), _value(node.right, env, sp)
        if (
            isinstance(node.op, ast.Pow)
            and not sp
            and abs(a) not in (0.0, 1.0)
            and not (abs(b) <= MAX_EXPONENT and abs(a) < math.inf and abs(b) * abs(math.log10(abs(a))) <= MAX_DIGITS)
        ):
            raise _GiveUp("power too large")
        return a**b if isinstance(node.op, ast.Pow) else _OPS[type(node.op)](a, b)
    except (ZeroDivisionError, ValueError):
        return complex(math.nan)  # with sympy too: nan makes it not equal
    except OverflowError:
        return complex(math.inf)


def _close(x: complex, y: complex) -> bool | None:
    """Whether two values agree; None if either is not finite (floats cannot tell)."""
    finite = cmath.isfinite(x) and cmath.isfinite(y)
    return abs(x - y) <= max(ABS_TOL, REL_TOL * max(abs(x), abs(y))) if finite else None


def _scalar_equal(a: str, b: str, sp: Any) -> bool:
    a, b = _strip_lhs(a), _strip_lhs(b)
    ta, tb = _parse(a), _parse(b)
    if a.lower() == b.lower() or ta is None or tb is None:
        return a.lower() == b.lower()
    names = sorted({n.id for n in [*ast.walk(ta), *ast.walk(tb)] if isinstance(n, ast.Name)} - {"pi", "oo", *_FUNCS})
    points = [{n: 0.5 + 0.6180339887 * ((3 * p + 2 * k) % 5 + 1) for k, n in enumerate(names)} for p in range(3)]
    agree = [_close(_value(ta, env), _value(tb, env)) for env in (points if names else [{}])]
    if sp is None or (None not in agree and not names):  # numbers: floats decide; no sympy: three points
        return None not in agree and all(agree)
    try:
        x, y = _value(ta, {}, sp), _value(tb, {}, sp)
        return bool(x == y or sp.simplify(x - y) == 0)
    except Exception:  # noqa: BLE001 - sympy cannot handle it (it raises many kinds): not equal
        return False


def _split_top(s: str, sep: str) -> list[str] | None:
    """`s` split at the top-level `sep`s; None if a bracket closes that `s` did not open."""
    parts: list[str] = []
    depth, start, i = 0, 0, 0
    while i < len(s) and depth >= 0:
        depth += (s[i] in "([{") - (s[i] in ")]}")
        if depth == 0 and s.startswith(sep, i):
            parts, start = parts + [s[start:i]], i + len(sep)
        i = max(i + 1, start)
    return parts + [s[start:]] if depth >= 0 else None


def _sequence(s: str) -> tuple[str, list[str]] | None:
    """('()' / '[)' / ... for a tuple or interval, 'set' for a set or bare list; its elements)."""
    if s.startswith("\\{") and s.endswith("\\}") and (inner := _split_top(s[2:-2], ",")):
        return "set", inner
    if s[:1] in ("(", "[") and s[-1:] in (")", "]") and len(items := _split_top(s[1:-1], ",") or []) > 1:
        return s[0] + s[-1], items
    parts = _split_top(s, ",") or []
    return ("set", parts) if len(parts) > 1 else None


def _equal(a: str, b: str, sp: Any) -> bool:
    ua, ub = _split_top(a, "\\cup") or [a], _split_top(b, "\\cup") or [b]
    if a == b or len(ua) > 1 or len(ub) > 1:
        return a == b or (len(ua) == len(ub) and all(_equal(x, y, sp) for x, y in zip(ua, ub)))
    sa, sb = _sequence(a), _sequence(b)
    if sa is None or sb is None:
        return sa is None and sb is None and _scalar_equal(a, b, sp)
    (kind, xs), (kind_b, ys) = sa, sb
    if kind != kind_b or len(xs) != len(ys) or len(xs) > 20:
        return False
    if kind != "set":
        return all(_equal(x, y, sp) for x, y in zip(xs, ys))
    for x in xs:  # multisets: each element matches a different one
        hit = next((k for k, y in enumerate(ys) if _equal(x, y, sp)), None)
        if hit is None:
            return False
        ys = ys[:hit] + ys[hit + 1 :]
    return True


def is_equiv(pred: str, gold: str, use_sympy: bool = True, timeout_s: float = 2.0) -> bool:
    """Whether the extracted answer `pred` equals the reference `gold` (rules: module docstring).
    Anything refused, unparsable or over `timeout_s` seconds is not equal."""
    a, b = normalize(pred), normalize(gold)
    if a is None or b is None:
        return False
    sp = _sympy() if use_sympy else None  # imported outside the time limit
    (sa, pa), (sb, pb) = a, b
    try:
        with _deadline(timeout_s):  # if exactly one side was a percentage, its value / 100 matches too
            scaled = (f"\\frac{{{sa}}}{{100}}", sb) if pa else (sa, f"\\frac{{{sb}}}{{100}}")
            return _equal(sa, sb, sp) or (pa != pb and _equal(*scaled, sp))
    except (_GiveUp, RecursionError):
        return False


class MathVerifier(Task):
    """A `Task` (the reward runner passes the reference to `score`) and a reward function (reads
    metadata["answer"] or ["ground_truth"]). Reward: 1 if correct, + `format_weight` if well-formed."""

    name = "math_verify"

    def __init__(
        self,
        mode: str = "auto",
        format_weight: float = 0.0,
        use_sympy: bool = True,
        timeout_s: float = 2.0,
        max_chars: int = 100_000,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"MathVerifier mode '{mode}' is not one of {', '.join(MODES)}")
        self.mode, self.format_weight, self.use_sympy = mode, format_weight, use_sympy
        self.timeout_s, self.max_chars = timeout_s, max_chars

    def __setstate__(self, state: dict) -> None:
        # A reward worker unpickles its function at start-up: import sympy then, not in a sample's time.
        self.__dict__.update(state)
        if self.use_sympy:
            _sympy()

    def extract(self, completion: str) -> str | None:
        return extract_answer(completion, self.mode) if len(completion) <= self.max_chars else None

    def is_correct(self, extracted: str, sample_answer: str, metadata: dict) -> bool:
        return is_equiv(extracted, gold_answer(sample_answer), self.use_sympy, self.timeout_s)

    def __call__(self, prompt: str, completion: str, metadata: dict) -> dict:
        gold = metadata["answer"] if "answer" in metadata else metadata["ground_truth"]
        score = self.score(completion, str(gold), metadata)
        return {"reward": score.reward, "correct": score.correct}


math_verifier = MathVerifier()
gsm8k_verifier = MathVerifier(mode="gsm8k")
boxed_verifier = MathVerifier(mode="boxed")


def math_reward(prompt: str, completion: str, metadata: dict) -> dict:
    """`math_verifier` as a plain reward function: the reference is metadata["answer"] or ["ground_truth"]."""
    return math_verifier(prompt, completion, metadata)

"""Math-answer verifier (titanrl/rewards/math_verify.py): a table of equal / not-equal answer
pairs over every normalisation rule, extraction strategies, adversarial inputs that must return
quickly, the no-sympy fallback, and a run through the real reward worker pool."""

import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.launch import REPO_ROOT

from titanrl.rewards import math_verify as mv
from titanrl.rewards.math_verify import MathVerifier, extract_answer, gold_answer, is_equiv, math_reward, normalize
from titanrl.rewards.runner import RewardItem, RewardRunner

# (prediction, reference, equal?) -- both already extracted; every pair is also checked swapped.
EQUIV = [
    # fractions
    (r"\frac{1}{2}", "0.5", True),
    (r"\dfrac{1}{2}", "1/2", True),
    (r"\tfrac{3}{4}", "0.75", True),
    (r"\frac12", r"\frac{1}{2}", True),
    (r"\frac{1}2", "0.5", True),
    (r"\frac1{2}", "0.5", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", True),
    (r"\frac{2}{4}", r"\frac{1}{2}", True),
    (r"-\frac{1}{3}", "-1/3", True),
    (r"\frac{-1}{3}", r"-\frac{1}{3}", True),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True),
    (r"\frac{3}{4}", "0.7", False),
    # spacing, delimiters, dollars
    (r"\left( 1, 2 \right)", "(1,2)", True),
    (r"1\!000", "1000", True),
    (r"1\,000", "1000", True),
    ("$5$", "5", True),
    (r"\$5", "5", True),
    (r"\( 5 \)", "5", True),
    (r"\displaystyle\frac{1}{2}", "0.5", True),
    (r"\$ 18.00", "18", True),
    ("5", "-5", False),
    ("\u22125", "-5", True),
    # units
    (r"5 \text{ cm}", "5", True),
    (r"5\text{cm}", "5", True),
    ("5cm", "5", True),
    ("5 dollars", "5", True),
    (r"12 \mbox{ inches}", "12", True),
    (r"5 \mathrm{m}", "5", True),
    (r"7 \text{ cm}^2", "7", True),
    ("3 square feet", "3", True),
    ("40 mph", "40", True),
    ("18 apples", "18", True),
    ("5 kg", "5", True),
    (r"\frac{1}{2} \text{ cup}", "0.5", True),
    ("5x", "5", False),
    (r"5 \text{ cm}", "6", False),
    # percentages: the sign drops; one-sided also matches value / 100; bare numbers never rescale
    (r"50\%", "50", True),
    (r"50\%", "0.5", True),
    ("50%", r"50\%", True),
    (r"12.5\%", "0.125", True),
    ("25 percent", "25", True),
    (r"25 \text{percent}", "0.25", True),
    (r"\frac{1}{4}", r"25\%", True),
    ("0.5", "50", False),
    (r"0.5\%", "50", False),
    (r"50\%", "5", False),
    (r"50\%", r"0.5\%", False),
    # thousands separators (only for a whole answer that is one number)
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    (r"\$1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("12,345.5", "12345.5", True),
    ("-1,000", "-1000", True),
    ("1,000", "1", False),
    ("(1,2)", "12", False),
    ("1,000", "1,001", False),
    # trailing zeros, leading dot, sentence period
    ("5.0", "5", True),
    ("5.00", "5", True),
    ("10.50", "10.5", True),
    (".5", "0.5", True),
    ("3.", "3", True),
    ("5.01", "5", False),
    ("+7", "7", True),
    # degrees
    (r"30^\circ", "30", True),
    (r"30^{\circ}", "30", True),
    ("30\u00b0", "30", True),
    ("45 degrees", "45", True),
    (r"30^\circ", "60", False),
    # a leading "x =" / "x \in"
    ("x = 3", "3", True),
    ("x=3", "3", True),
    ("y = 2x + 3", "2x+3", True),
    (r"k = \frac{1}{2}", "0.5", True),
    (r"x \in [1, 2]", "[1,2]", True),
    (r"\theta = \pi", r"\pi", True),
    ("x = 3", "4", False),
    ("x=1, y=2", "1, 2", True),
    # tuples and intervals (ordered, brackets must agree), unions, sets and bare lists (unordered)
    ("(1, 2)", "(1,2)", True),
    ("[1, 3)", "[1,3)", True),
    (r"(-\infty, 2]", r"(-\infty,2]", True),
    (r"(-\infty, \frac{1}{2})", r"(-\infty, 0.5)", True),
    (r"(0.5, 1)", r"(\frac12, 1)", True),
    (r"(1, 2) \cup (3, 4)", r"(1,2)\cup(3,4)", True),
    (r"\{1, 2, 3\}", r"\{3, 2, 1\}", True),
    ("1, 2", "2, 1", True),
    (r"(\sqrt{2}, 3)", "(1.41421356237, 3)", True),
    ("(1,(2,3))", "(1, (2, 3))", True),
    ("(1,2)", "(2,1)", False),
    ("(1,3)", "[1,3]", False),
    ("[1,3)", "[1,3]", False),
    ("(1,2)", "1,2", False),
    (r"\{1,2\}", r"\{1,2,3\}", False),
    ("1,2", "1,2,2", False),
    ("1,2,2", "1,1,2", False),
    (r"(-\infty, 2)", r"(-\infty, 3)", False),
    (r"(1,2)\cup(3,4)", r"(1,2)\cup(3,5)", False),
    (r"(1,2)\cup(3,4)", "(1,2)", False),
    (r"\infty", r"-\infty", False),
    (r"\infty", r"\infty", True),
    # expressions
    (r"2\sqrt{3}", r"\sqrt{12}", True),
    (r"2\pi", r"2 \cdot \pi", True),
    ("3^{2}", "9", True),
    ("3^2", "9", True),
    ("2^{10}", "1024", True),
    (r"\sqrt[3]{8}", "2", True),
    (r"\sqrt{2}^2", "2", True),
    (r"4 \times 3", "12", True),
    (r"12 \div 4", "3", True),
    (r"\frac{\pi}{2}", "1.5707963268", True),
    (r"\sqrt{8}", r"2\sqrt{2}", True),
    (r"-\sqrt{2}", "-1.41421356237", True),
    ("10^{-3}", "0.001", True),
    ("2^{-1}", "0.5", True),
    ("1000000", "1000000.5", True),
    ("0.0000000001", "0", True),
    (r"2\pi r", r"2r\pi", True),
    (r"\pi", "3.14", False),
    (r"\pi", "3.14159", True),
    (r"\pi", "3.1416", False),
    (r"\frac{\sqrt{3}}{2}", "0.866", False),
    (r"2\sqrt{3}", r"3\sqrt{2}", False),
    ("3^{2}", "6", False),
    ("1000", "1000.01", False),
    ("1", "-1", False),
    (r"\sqrt{2}", "1.414", False),
    ("12", "21", False),
    (r"\frac{1}{0}", r"\infty", False),
    ("10^{300}\\cdot10^{300}", "10^{600}", True),
    ("10^{400}", "10^{400}+1", False),
    # symbolic (sympy)
    ("x^2+2x+1", "(x+1)^2", True),
    (r"\frac{x}{2}", "0.5x", True),
    ("2(a+b)", "2a+2b", True),
    (r"\sin(x)^2 + \cos(x)^2", "1", True),
    (r"\frac{1}{x}+\frac{1}{y}", r"\frac{x+y}{xy}", True),
    ("a^2-b^2", "(a-b)(a+b)", True),
    ("2x+3", "3+2x", True),
    (r"\frac{x^2-1}{x-1}", "x+1", True),
    ("x+1", "x-1", False),
    ("(x+1)^2", "x^2+1", False),
    ("2x+3", "2y+3", False),
    ("a^2-b^2", "(a-b)^2", False),
    ("x", "y", False),
    (r"\frac{x^3 - x}{x}", "x^2 - 1", True),
    (r"\ln(x^2)", r"2\log(x)", False),
    # text and choices
    (r"\text{Yes}", "yes", True),
    ("(B)", "B", True),
    (r"\text{(C)}", "C", True),
    (r"\textbf{Monday}", "monday", True),
    (r"\text{yes}", "no", False),
    ("A", "B", False),
    (r"\text{Devon}", r"\text{Jane}", False),
    # nested boxes inside an extracted answer
    (r"\boxed{2}", "2", True),
    (r"\frac{\boxed{1}}{2}", "0.5", True),
    ("", "", False),
    ("2", "", False),
]

# (completion, mode, the extracted answer)
EXTRACT = [
    (r"so \boxed{42}.", "auto", "42"),
    (r"\boxed{\frac{\boxed{1}}{2}}", "auto", r"\frac{\boxed{1}}{2}"),
    (r"first \boxed{1} then \boxed{2}", "auto", "2"),
    (r"\boxed{\boxed{2}}", "auto", r"\boxed{2}"),
    (r"\fbox{7}", "auto", "7"),
    (r"so \boxed 5 done", "auto", "5"),
    (r"\boxed{\{1,2\}}", "auto", r"\{1,2\}"),
    (r"\boxed{\frac{1}{2}", "boxed", None),
    (r"\boxed{\frac{1}{2}", "auto", "2"),
    (r"\boxed{3} and then }}} stray", "auto", "3"),
    (r"\boxed{\boxed{1}", "auto", "1"),
    ("\\boxed{1}\n#### 2", "auto", "1"),
    ("\\boxed{1}\n#### 2", "gsm8k", "2"),
    ("... so 40 in all.\n#### 42", "auto", "42"),
    ("#### 1,234", "auto", "1,234"),
    ("#### $18", "gsm8k", "$18"),
    ("#### 42\nthen more text 7", "gsm8k", "42"),
    ("The answer is 42.", "auto", "42"),
    ("The final answer is $\\frac{1}{2}$. I hope", "auto", "\\frac{1}{2}"),
    ("Answer: 3.5", "auto", "3.5"),
    ("**Answer:** 7", "auto", "7"),
    ("The answer is:\n 9", "auto", "9"),
    ("She has 12 apples and eats 5, so 7 remain", "auto", "7"),
    ("It costs 1,200 dollars", "auto", "1,200"),
    ("-3 is the result", "auto", "-3"),
    ("the ratio is 3/4", "auto", "3/4"),
    ("no numbers here", "auto", None),
    ("the answer is 5", "boxed", None),
    ("the answer is 5", "strict", "5"),
    ("so 12 then 13", "strict", None),
    ("so 12 then 13", "last_number", "13"),
    ("The answer is 6. Not 7", ("answer_is", "last_number"), "6"),
]

# (completion, reference, correct?) through MathVerifier.score with mode "auto"
SCORE = [
    (r"Thus \boxed{42}.", "42", True),
    (r"\boxed{\frac{\boxed{1}}{2}}", "0.5", True),
    (r"first \boxed{1}, then \boxed{2}", "2", True),
    (r"first \boxed{1}, then \boxed{2}", "1", False),
    (r"\boxed{\boxed{2}}", "2", True),
    (r"$\boxed{\dfrac{3}{4}}$", "0.75", True),
    (r"The answer is \boxed{x = 3}", "3", True),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", True),
    ("So the total is 18 dollars.\n#### 18", "18", True),
    ("#### 1,234", "1234", True),
    ("#### 5 apples", "5", True),
    ("The final answer is $\\frac{1}{2}$. Done", "0.5", True),
    ("She has 7 left", "7", True),
    ("She has 7 left", "8", False),
    (r"\boxed{42}", "Natalia sold 48/2 = 24 clips.\n#### 72", False),
    (r"\boxed{72}", "Natalia sold 48/2 = 24 clips.\n#### 72", True),
    ("42", r"so \boxed{42}", True),
    (r"\boxed{50\%}", "0.5", True),
    (r"\boxed{(1, 2)}", "(2, 1)", False),
    (r"\boxed{9^{9^{9^9}}}", "1", False),
]

# Answers whose evaluation could hang (towers of powers, huge roots, deep nesting, long text):
# each comparison must say "not equal" within 2 s.
PATHOLOGICAL = [
    "9^{9^{9^9}}",
    "9^{9^{9^{9}}}+1",
    "2^{2^{2^{2^{2^{2}}}}}",
    "(1.0000001)^{1000000000}",
    "10^{10^{10}}",
    "x^{99999999}",
    r"\sqrt[0.0001]{2}",
    "x^{x^{x^{x}}}",
    "(" * 150 + "1" + ")" * 150,
    r"\frac{" * 60 + "1" + "}{2}" * 60,
    "1" * 5000,
    r"\sin(10^{300})",
    r"{9}^{{9}^{{9}^{9}}}",
    "99999999999999999999^{999}",
    "(2^{1000})^{1000}",
]


def test_table_has_enough_cases():
    assert len(EQUIV) + len(EXTRACT) + len(SCORE) + len(PATHOLOGICAL) >= 150


# Pairs that only sympy decides (beyond floats; or equal at the three sample points only).
NEEDS_SYMPY = {("10^{300}\\cdot10^{300}", "10^{600}"), (r"\ln(x^2)", r"2\log(x)")}


@pytest.mark.parametrize("pred,gold,expected", EQUIV)
def test_equivalence_table(pred, gold, expected):
    if (pred, gold) in NEEDS_SYMPY and mv._sympy() is None:
        pytest.skip("needs sympy (the `math` extra)")
    assert is_equiv(pred, gold) is expected
    assert is_equiv(gold, pred) is expected


@pytest.mark.parametrize("text,mode,expected", EXTRACT)
def test_extraction(text, mode, expected):
    assert extract_answer(text, mode) == expected


@pytest.mark.parametrize("completion,gold,correct", SCORE)
def test_verifier_scores(completion, gold, correct):
    score = mv.math_verifier.score(completion, gold, {})
    assert score.correct is correct and score.reward == float(correct)


@pytest.mark.parametrize("answer", PATHOLOGICAL)
def test_pathological_answers_return_quickly(answer):
    start = time.monotonic()
    assert not is_equiv(answer, "1")
    assert not is_equiv(answer, answer + "+1")
    assert not mv.math_verifier.score(rf"\boxed{{{answer}}}", "3", {}).correct
    assert time.monotonic() - start < 2.0


def test_huge_completions_and_box_storms_return_quickly():
    start = time.monotonic()
    for text in [r"\boxed{" * 14000, "{" * 100_000, "x" * 200_000, r"\frac{" * 15000, "answer is " * 9000]:
        assert not mv.math_verifier.score(text, "1", {}).correct
    assert not mv.math_verifier.extract("1" * 100_001)  # over max_chars: refused, not scanned
    assert time.monotonic() - start < 2.0


def test_slow_sympy_is_cut_by_the_time_limit(monkeypatch):
    """A sympy call that takes too long is cut by the SIGALRM guard, which is then put back."""
    pytest.importorskip("sympy")
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    assert not is_equiv("(a+b+c+d+e+f+g)^{40}", "1", timeout_s=0.5)
    monkeypatch.setattr("sympy.simplify", lambda e: time.sleep(30))
    assert not is_equiv("x^2+2x+1", "(x+1)^2", timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_outside_the_main_thread_size_checks_still_bound_the_time():
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=[is_equiv(a, "1") for a in PATHOLOGICAL]))
    start = time.monotonic()
    worker.start()
    worker.join(10)
    assert out["r"] == [False] * len(PATHOLOGICAL) and time.monotonic() - start < 3.0


NO_SYMPY = [
    (r"\frac{1}{2}", "0.5", True),
    (r"2\sqrt{3}", r"\sqrt{12}", True),
    (r"50\%", "0.5", True),
    ("(1,2)", "(1, 2)", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("2x+3", "3+2x", True),
    (r"\sin(x)^2+\cos(x)^2", "1", True),
    ("x+1", "x-1", False),
    ("(x+1)^2", "x^2+1", False),
    (r"\pi", "3.14", False),
    ("10^{400}", "10^{400}", True),
    ("10^{300}\\cdot10^{300}", "10^{600}", False),  # beyond floats: undecidable without sympy
    ("9^{9^{9^9}}", "1", False),
    ("x^{99999999}", "x", False),
]


@pytest.mark.parametrize("pred,gold,expected", NO_SYMPY)
def test_without_sympy_numeric_fallback(monkeypatch, pred, gold, expected):
    monkeypatch.setitem(sys.modules, "sympy", None)  # `import sympy` now fails
    assert mv._sympy() is None
    start = time.monotonic()
    assert is_equiv(pred, gold) is expected
    assert MathVerifier(use_sympy=False).score(rf"\boxed{{{pred}}}", gold, {}).correct is expected
    assert time.monotonic() - start < 2.0


def test_module_imports_and_verifies_without_sympy():
    code = (
        "import sys; sys.modules['sympy'] = None\n"
        "from titanrl.rewards.math_verify import is_equiv\n"
        "print(is_equiv('x^2+2x+1', '(x+1)^2'), is_equiv('x+1', 'x-1'), 'sympy' in sys.modules and sys.modules['sympy'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "None"]


def test_normalize_reports_percentages_and_refuses_long_answers():
    assert normalize(r"50\%") == ("50", True) and normalize("50") == ("50", False)
    assert normalize(r"\$1,000.00") == ("1000", False) and normalize("(1, 2)") == ("(1,2)", False)
    assert normalize("1" * 401) is None and normalize("  ") is None


def test_gold_answer_extracts_from_solutions():
    assert (
        gold_answer("so she sold 72.\n#### 72") == "72"
        and gold_answer(r"Hence $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    )
    assert gold_answer(5) == "5" and gold_answer("1, 2") == "1, 2"


def test_reward_function_form_and_format_weight():
    assert math_reward("p", r"\boxed{4}", {"answer": "4"}) == {"reward": 1.0, "correct": True}
    assert math_reward("p", r"\boxed{4}", {"ground_truth": "#### 5"}) == {"reward": 0.0, "correct": False}
    with pytest.raises(KeyError):
        math_reward("p", r"\boxed{4}", {})
    strict = MathVerifier(mode="boxed", format_weight=0.1)
    assert strict("p", r"\boxed{4}", {"answer": "4"})["reward"] == pytest.approx(1.1)
    assert strict("p", r"\boxed{3}", {"answer": "4"})["reward"] == pytest.approx(0.1)
    assert strict("p", "4", {"answer": "4"}) == {"reward": 0.0, "correct": False}  # no box: malformed
    with pytest.raises(ValueError, match="mode 'nope'"):
        MathVerifier(mode="nope")


def test_through_the_reward_worker_pool():
    """The verifier in the real RewardRunner (spawned worker, per-sample timeout): right rewards,
    pathological answers are wrong rather than timeouts, and the batch ends well within the timeout."""
    runner = RewardRunner(mv.math_verifier, num_workers=1, timeout_s=10.0, failure_reward=-1.0, memory_limit_mb=1024)
    try:
        assert [r.reward for r in runner([RewardItem("p", r"\boxed{1}", "1")])] == [1.0]  # the worker is up
        items = [
            RewardItem("p", r"So \boxed{\frac{1}{2}}.", "0.5"),
            RewardItem("p", "#### 41", "42"),
            RewardItem("p", r"\boxed{9^{9^{9^{9}}}}", "1"),
            RewardItem("p", r"\boxed{" * 20000, "1"),
            RewardItem("p", r"\boxed{(a+b+c+d+e+f+g)^{40}}", "1"),
            RewardItem("p", "x^2+2x+1 is \\boxed{(x+1)^2}", "x^2+2x+1"),
        ]
        start = time.monotonic()
        out = runner(items)
        assert time.monotonic() - start < runner.timeout_s
        assert [r.failed for r in out] == [None] * len(items)
        assert [r.reward for r in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert [r.correct for r in out] == [True, False, False, False, False, True]
    finally:
        runner.close()

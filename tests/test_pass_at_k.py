"""pass@k (titanrl/rewards/pass_at_k.py) against the definition, 1 - C(n-c, k) / C(n, k), computed
in exact rationals with math.comb; the product form must agree to float64 rounding."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.rewards.pass_at_k import pass_at_k, pass_ks


def reference(n: int, c: int, k: int) -> float:
    """The Codex paper's definition in exact arithmetic, rounded once to float64."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@st.composite
def counts(draw):
    n = draw(st.integers(min_value=1, max_value=300))
    return n, draw(st.integers(min_value=0, max_value=n)), draw(st.integers(min_value=1, max_value=n))


@settings(max_examples=400, deadline=None)
@given(counts())
def test_matches_exact_rational_reference(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(reference(n, c, k), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (10, 0, 1, 0.0),  # nothing correct: 0 for every k
        (10, 0, 10, 0.0),
        (10, 10, 1, 1.0),  # everything correct: 1
        (10, 10, 10, 1.0),
        (10, 8, 3, 1.0),  # n - c < k: every k-subset holds a correct sample
        (10, 1, 1, 0.1),  # pass@1 is the fraction correct
        (5, 2, 5, 1.0),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (200, 1, 100, 0.5),  # 1 - C(199,100)/C(200,100): binomials far beyond float64
    ],
)
def test_edge_cases(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(reference(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_mean_and_grows_with_k():
    for n in range(1, 12):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values)


def test_invalid_counts_are_errors():
    with pytest.raises(ValueError, match="correct <= samples"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(4, 2, 0)


def test_reported_ks_are_powers_of_two_then_k():
    assert pass_ks(1) == [1]
    assert pass_ks(2) == [1, 2]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(10) == [1, 2, 4, 8, 10]

"""pass@k: the chance that at least one of k samples of a prompt is correct, estimated without
bias from n >= k samples of which c are correct (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", the Codex paper):

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds the binomials (C(200, 100) overflows a float64), and each factor
lies in [0, 1), so the result is accurate to a few ulps. A suite's pass@k is the mean of its
prompts' estimates; mean@k is the mean correctness of all its samples (pass@1 in expectation).
"""

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` correct samples out of `n` (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= samples, got correct={c}, samples={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= samples, got k={k}, samples={n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(k: int) -> list[int]:
    """The j reported for k samples per prompt: the powers of two below k, and k (1, 2, 4, ..., k)."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]

"""Parity suite: every advantage estimator and policy loss of titanrl against its published formula.

The references below are written here from the papers (cited at each) and, for the options named
after them, from verl's and OpenRLHF's documentation: plain loops, in float64, with group means
in exact rational arithmetic (`fractions.Fraction`), so that "a group of equal rewards has
advantage 0" holds in the reference by construction. The inputs are random ragged batches: rows of
different lengths and offsets, a row with no trained token, environment-token holes inside
completions, a group of equal rewards that are not binary fractions (0.7), ratios past every clip
and KL log ratios past every clamp.

Each check is parametrised by `mutation`. `None` is the parity check itself. Every other id breaks
one thing the check is meant to pin, either in the reference ("ref:...": the formula of a
neighbouring definition, e.g. the population std where GRPO uses the unbiased one) or in titanrl
("impl:...": a constant or helper monkeypatched), and asserts that the comparison then *fails*:
a check that stopped discriminating shows up as a failing test.
"""

import math
from fractions import Fraction

import pytest
import torch

from titanrl.algorithms import ALGORITHMS, AdvantageInputs, common, grpo, rloo
from titanrl.algorithms.cispo import cispo_loss
from titanrl.algorithms.common import clipped_pg_loss
from titanrl.algorithms.dpo import dpo_loss
from titanrl.algorithms.gspo import gspo_loss
from titanrl.algorithms.ppo import value_loss
from titanrl.algorithms.reinforce_pp import reinforce_pp_advantages
from titanrl.algorithms.sapo import sapo_loss
from titanrl.config.algorithm import Algorithm as AlgorithmConfig

F64 = torch.float64
P, G, T = 4, 3, 10  # prompts, group size, columns; B = 12 rows
B = P * G
EQUAL_GROUP = 2  # its rewards are all 0.7: in float64, 0.7 - mean(0.7, 0.7, 0.7) is 1.1e-16, not 0


def ragged_batch(seed: int, extremes=(-3.0, 25.0, -800.0)) -> dict:
    """A random ragged batch. `extremes` are KL log ratios log pi - log pi_ref planted on three
    tokens (k3 is e^3 - 4 = 16 at -3; |log r'| > 20 beyond)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        start = int(torch.randint(0, 4, (1,), generator=g))
        length = int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[b, start : start + length] = 1.0
        if length >= 4 and b % 2:  # an environment token inside the completion: not trained on
            mask[b, start + length // 2] = 0.0
    mask[5] = 0.0  # a sample with no trained token (an overlong-filtered one)
    rewards = torch.cat(
        [
            torch.randn(G, generator=g, dtype=F64),
            torch.tensor([1.0, 0.0, 1.0], dtype=F64),
            torch.full((G,), 0.7, dtype=F64),
            torch.tensor([0.25, -1.5, 0.25], dtype=F64),
        ]
    )
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=F64)
    old = lp + 0.6 * torch.randn(B, T, generator=g, dtype=F64)
    ref = lp + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    adv_B = torch.randn(B, generator=g, dtype=F64)
    adv_BT = torch.randn(B, T, generator=g, dtype=F64)
    first = [int(mask[b].nonzero()[0]) if mask[b].any() else 0 for b in range(B)]
    # Tokens with A < 0 and ratio e^1.5 = 4.5 > 3: past PPO's clip and dual-clip's cap c = 3.
    for b in (0, 4):
        adv_B[b], adv_BT[b, first[b]] = -abs(adv_B[b]) - 0.5, -1.0
        old[b, first[b]] = lp[b, first[b]] - 1.5
    for b, x in zip((1, 2, 3), extremes):
        ref[b, first[b]] = lp[b, first[b]] - x
    return dict(
        mask=mask,
        rewards=rewards,
        greedy=torch.randn(P, generator=g, dtype=F64),
        kl=torch.rand(B, T, generator=g, dtype=F64) * mask,
        values=torch.randn(B, T, generator=g, dtype=F64),
        lp=lp,
        old=old,
        ref=ref,
        adv_B=adv_B,
        adv_BT=adv_BT,
        is_w=0.5 + torch.rand(B, T, generator=g, dtype=F64),
    )


def _close(got, want, exact_zeros: bool) -> bool:
    got, want = torch.as_tensor(got, dtype=F64), torch.as_tensor(want, dtype=F64)
    if got.shape != want.shape or not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return False
    if exact_zeros and not (got[want == 0] == 0).all():  # zero by definition: exactly zero
        return False
    return torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def verdict(mutation: str | None, pairs, exact_zeros: bool = False) -> None:
    """`pairs` of (titanrl, reference) agree; under a mutation, at least one pair must not."""
    agree = all(_close(got, want, exact_zeros) for got, want in pairs)
    if mutation is None:
        assert agree, "titanrl differs from the published formula"
    else:
        assert not agree, f"mutation {mutation!r} went unnoticed: the check does not pin it"


def _no_equal_group_guard(monkeypatch, module):
    monkeypatch.setattr(module, "equal_groups", lambda r_PG: torch.zeros(r_PG.shape[0], 1, dtype=torch.bool))


def _float32_arithmetic(monkeypatch, module):
    monkeypatch.setattr(module, "group_rewards", lambda r, g: r.float().view(-1, g))


# ---- group-relative advantages: GRPO (Shao et al. 2024, arXiv:2402.03300), Dr.GRPO (Liu et al.
# 2025, arXiv:2503.20783), RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740) ----


def ref_grpo(rewards, group_size, normalize_std, std="unbiased", eps=1e-6, singleton="zero"):
    """A_i = (r_i - mean) / (std + eps), std unbiased (the paper's and verl's); Dr.GRPO: r_i - mean.
    A group of one: titanrl 0 (the sample is its own mean); verl (singleton='verl') uses mean 0 and
    std 1, i.e. r / (1 + eps)."""
    out = []
    for p in range(len(rewards) // group_size):
        grp = [Fraction(x) for x in rewards[p * group_size : (p + 1) * group_size]]
        if group_size == 1:
            r = float(grp[0])
            out.append(0.0 if singleton == "zero" else (r / (1 + eps) if normalize_std else r))
            continue
        mean = sum(grp) / group_size
        var = sum((x - mean) ** 2 for x in grp) / (group_size - 1 if std == "unbiased" else group_size)
        for x in grp:
            out.append(float(x - mean) / (math.sqrt(var) + eps) if normalize_std else float(x - mean))
    return out


GRPO_MUTATIONS = {
    "ref:population_std": dict(std="population"),
    "ref:normalize_std_swapped": "swap",
    "impl:float32_arithmetic": lambda mp: _float32_arithmetic(mp, grpo),
    "impl:no_exact_zero_for_equal_groups": lambda mp: _no_equal_group_guard(mp, grpo),
}


@pytest.mark.parametrize(
    "normalize_std,mutation",
    [(True, m) for m in (None, *GRPO_MUTATIONS)]
    + [(False, m) for m in (None, *GRPO_MUTATIONS) if m != "ref:population_std"],  # Dr.GRPO: no std
    ids=lambda v: {True: "grpo", False: "dr_grpo"}.get(v, str(v)) if isinstance(v, bool) else str(v),
)
def test_grpo_advantages(mutation, normalize_std, monkeypatch):
    batch = ragged_batch(0)
    rewards, knobs = batch["rewards"], {}
    m = GRPO_MUTATIONS.get(mutation)
    if callable(m):
        m(monkeypatch)
    elif isinstance(m, dict):
        knobs = m
    cfg = AlgorithmConfig(name="grpo", group_size=G)
    cfg.tables = {"grpo": {"normalize_std": normalize_std}}
    inputs = AdvantageInputs(rewards, batch["mask"], None, None, None, None, None)
    got = ALGORITHMS["grpo"](cfg).advantages(inputs).advantages
    ref_std = (not normalize_std) if m == "swap" else normalize_std
    want = ref_grpo(rewards.tolist(), G, ref_std, **knobs)
    assert mutation is not None or got[EQUAL_GROUP * G : EQUAL_GROUP * G + G].tolist() == [0.0] * G
    verdict(mutation, [(got, want)], exact_zeros=True)


@pytest.mark.parametrize("mutation", [None, "ref:verl_group_of_one"])
def test_grpo_group_of_one_is_titanrl_choice(mutation):
    """A group of one: titanrl gives 0 (no baseline but the sample itself); verl gives r / (1 + eps).
    A deliberate difference (docs/algorithms.md, 'titanrl vs verl vs OpenRLHF')."""
    rewards = ragged_batch(1)["rewards"]
    want = ref_grpo(rewards.tolist(), 1, True, singleton="verl" if mutation else "zero")
    verdict(mutation, [(grpo.group_advantages(rewards, 1, normalize_std=True), want)], exact_zeros=True)


def ref_rloo(rewards, group_size, leave_one_out=True):
    """A_i = r_i - 1/(G-1) sum_{j != i} r_j (leave_one_out=False: the mean including r_i)."""
    out = []
    for p in range(len(rewards) // group_size):
        grp = [Fraction(x) for x in rewards[p * group_size : (p + 1) * group_size]]
        for x in grp:
            base = (sum(grp) - x) / (group_size - 1) if leave_one_out else sum(grp) / group_size
            out.append(float(x - base))
    return out


RLOO_MUTATIONS = {
    "ref:baseline_includes_the_sample": dict(leave_one_out=False),
    "impl:float32_arithmetic": lambda mp: _float32_arithmetic(mp, rloo),
    "impl:no_exact_zero_for_equal_groups": lambda mp: _no_equal_group_guard(mp, rloo),
}


@pytest.mark.parametrize("mutation", [None, *RLOO_MUTATIONS])
def test_rloo_advantages(mutation, monkeypatch):
    batch = ragged_batch(2)
    m, knobs = RLOO_MUTATIONS.get(mutation), {}
    if callable(m):
        m(monkeypatch)
    elif m:
        knobs = m
    inputs = AdvantageInputs(batch["rewards"], batch["mask"], None, None, None, None, None)
    got = ALGORITHMS["rloo"](AlgorithmConfig(name="rloo", group_size=G)).advantages(inputs).advantages
    verdict(mutation, [(got, ref_rloo(batch["rewards"].tolist(), G, **knobs))], exact_zeros=True)


# ---- ReMax (Li et al. 2024, arXiv:2310.10505), the KL in the reward two ways ----


def ref_remax(rewards, greedy, mask, kl, beta, mode):
    """'sequence': A_i = r_i - beta sum_t KL_t - r_greedy on every token; 'reward_to_go' (verl's
    ReMax): A_t = r_i - beta sum_{s >= t} KL_s - r_greedy; 'exclusive' (a mutation): s > t."""
    out = []
    for i, (m_row, kl_row) in enumerate(zip(mask, kl)):
        row = [0.0] * T
        for t in range(T):
            if m_row[t]:
                if mode == "sequence":
                    window = range(T)
                else:
                    window = range(t if mode == "reward_to_go" else t + 1, T)
                row[t] = rewards[i] - beta * math.fsum(kl_row[s] for s in window if m_row[s]) - greedy[i // G]
        out.append(row)
    return out


@pytest.mark.parametrize(
    "kl_reward,mutation",
    [
        ("sequence", None),
        ("sequence", "ref:reward_to_go"),
        ("reward_to_go", None),
        ("reward_to_go", "ref:sequence"),
        ("reward_to_go", "ref:exclusive"),
    ],
)
def test_remax_advantages(kl_reward, mutation):
    batch, beta = ragged_batch(3), 0.1
    cfg = AlgorithmConfig(name="remax", group_size=G, kl_coef=beta, kl_in_reward=True)
    cfg.tables = {"remax": {"kl_reward": kl_reward}}
    inputs = AdvantageInputs(batch["rewards"], batch["mask"], batch["kl"], None, None, batch["greedy"], None)
    got = common.per_token(ALGORITHMS["remax"](cfg).advantages(inputs).advantages, batch["mask"]) * batch["mask"]
    mode = mutation.removeprefix("ref:") if mutation else kl_reward
    want = ref_remax(*(batch[k].tolist() for k in ("rewards", "greedy", "mask", "kl")), beta, mode)
    verdict(mutation, [(got, want)], exact_zeros=True)


# ---- REINFORCE++ and REINFORCE++-baseline (Hu 2025, arXiv:2501.03262), PPO's GAE (Schulman et
# al. 2016, arXiv:1506.02438) and global whitening ----


def ref_whiten(values, mask, std="population"):
    flat = [x for row, m in zip(values, mask) for x, mm in zip(row, m) if mm]
    mean = math.fsum(flat) / len(flat)
    n = len(flat) if std == "population" else len(flat) - 1
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in flat) / n)
    return [[(x - mean) / (sd + 1e-8) if mm else 0.0 for x, mm in zip(row, m)] for row, m in zip(values, mask)]


def ref_returns(rewards, mask, gamma):
    out = []
    for r_row, m_row in zip(rewards, mask):
        running, row = 0.0, [0.0] * T
        for t in reversed(range(T)):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def ref_reinforce_pp(scores, mask, kl, beta, gamma, baseline, std="population"):
    """Token rewards -beta KL_t, the (centred) score on the last completion token, returns, global
    whitening. baseline: 'none'; 'group' (s_i - mean of its group); mutations: 'loo' (leave-one-out
    mean), 'verl' (group-centred KL-penalised total on every token, no per-token KL)."""
    if baseline == "verl":
        totals = [s - beta * math.fsum(k for k, m in zip(kl[i], mask[i]) if m) for i, s in enumerate(scores)]
        centred = [
            float(Fraction(x) - sum(map(Fraction, totals[i // G * G : i // G * G + G])) / G)
            for i, x in enumerate(totals)
        ]
        return ref_whiten([[c * m for m in m_row] for c, m_row in zip(centred, mask)], mask, std)
    if baseline in ("group", "loo"):
        groups = [list(map(Fraction, scores[p * G : (p + 1) * G])) for p in range(P)]
        mean = [
            (sum(groups[i // G]) - Fraction(s)) / (G - 1) if baseline == "loo" else sum(groups[i // G]) / G
            for i, s in enumerate(scores)
        ]
        scores = [float(Fraction(s) - m) for s, m in zip(scores, mean)]
    rewards = []
    for i, (m_row, kl_row) in enumerate(zip(mask, kl)):
        row = [-beta * k if m else 0.0 for k, m in zip(kl_row, m_row)]
        last = max((t for t in range(T) if m_row[t]), default=None)
        if last is not None:
            row[last] += scores[i]
        rewards.append(row)
    return ref_whiten(ref_returns(rewards, mask, gamma), mask, std)


@pytest.mark.parametrize(
    "baseline,gamma,beta,mutation",
    [
        ("none", 1.0, 0.05, None),
        ("none", 0.9, 0.0, None),
        ("group", 1.0, 0.05, None),
        ("group", 0.9, 0.0, None),
        ("none", 1.0, 0.05, "ref:unbiased_std"),
        ("group", 1.0, 0.05, "ref:unbiased_std"),
        ("group", 1.0, 0.05, "ref:no_baseline"),
        ("group", 1.0, 0.05, "ref:leave_one_out_baseline"),
        ("group", 1.0, 0.05, "ref:verl_baseline_on_the_penalised_total"),
        ("none", 1.0, 0.05, "ref:group_baseline"),
    ],
)
def test_reinforce_pp_advantages(baseline, gamma, beta, mutation):
    batch = ragged_batch(4)
    cfg = AlgorithmConfig(name="reinforce_pp", group_size=G, kl_coef=beta, kl_in_reward=beta > 0)
    cfg.tables = {"reinforce_pp": {"gamma": gamma, "baseline": baseline}}
    kl = batch["kl"] if beta else None
    got = ALGORITHMS["reinforce_pp"](cfg).advantages(
        AdvantageInputs(batch["rewards"], batch["mask"], kl, None, None, None, None)
    )
    ref_baseline = {
        "ref:no_baseline": "none",
        "ref:leave_one_out_baseline": "loo",
        "ref:verl_baseline_on_the_penalised_total": "verl",
        "ref:group_baseline": "group",
    }.get(mutation, baseline)
    std = "unbiased" if mutation == "ref:unbiased_std" else "population"
    args = (batch["rewards"].tolist(), batch["mask"].tolist(), batch["kl"].tolist(), beta, gamma)
    verdict(mutation, [(got.advantages, ref_reinforce_pp(*args, ref_baseline, std))], exact_zeros=True)
    assert mutation is not None or torch.equal(
        got.advantages,
        reinforce_pp_advantages(
            batch["rewards"], batch["mask"], kl, beta, gamma, baseline_group_size=G if baseline == "group" else 0
        ),
    )


def ref_gae(rewards, values, mask, gamma, lam, skip_holes=True):
    """delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1} over each row's
    trained tokens (skip_holes=False, a mutation: over every position from the first to the last)."""
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        on = [t for t in range(T) if m_row[t]]
        idx = on if skip_holes or not on else list(range(on[0], on[-1] + 1))
        adv, ret, last = [0.0] * T, [0.0] * T, 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v_row[idx[k + 1]] if k + 1 < len(idx) else 0.0
            last = r_row[t] + gamma * next_v - v_row[t] + gamma * lam * last
            adv[t], ret[t] = (last, last + v_row[t]) if m_row[t] else (0.0, 0.0)
        adv_out.append(adv)
        ret_out.append(ret)
    return adv_out, ret_out


@pytest.mark.parametrize(
    "mutation", [None, "ref:unbiased_std", "ref:recursion_through_holes", "ref:gamma_lambda_swapped"]
)
def test_ppo_gae_advantages(mutation):
    batch, beta, gamma, lam = ragged_batch(5), 0.05, 0.99, 0.9
    cfg = AlgorithmConfig(name="ppo", group_size=G, kl_coef=beta, kl_in_reward=True)
    cfg.tables = {"ppo": {"gamma": gamma, "lam": lam}}
    values = batch["values"] * batch["mask"]
    inputs = AdvantageInputs(batch["rewards"], batch["mask"], batch["kl"], values, None, None, None)
    got = ALGORITHMS["ppo"](cfg).advantages(inputs)
    token_rewards = [
        [(-beta * k if m else 0.0) for k, m in zip(kl_row, m_row)]
        for kl_row, m_row in zip(batch["kl"].tolist(), batch["mask"].tolist())
    ]
    for i, m_row in enumerate(batch["mask"].tolist()):
        if any(m_row):
            token_rewards[i][max(t for t in range(T) if m_row[t])] += batch["rewards"][i].item()
    g_, l_ = (lam, gamma) if mutation == "ref:gamma_lambda_swapped" else (gamma, lam)
    adv, ret = ref_gae(
        token_rewards, values.tolist(), batch["mask"].tolist(), g_, l_, mutation != "ref:recursion_through_holes"
    )
    std = "unbiased" if mutation == "ref:unbiased_std" else "population"
    verdict(mutation, [(got.advantages, ref_whiten(adv, batch["mask"].tolist(), std)), (got.returns_BT, ret)])


# ---- policy losses: PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with
# dual clip (Ye et al. 2020, arXiv:1912.09729), Schulman's KL estimators (2020) with verl's k3
# clamp, the four aggregations; GSPO, CISPO, SAPO ----

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
NORM = 8.0  # the constant C of seq-mean-token-sum-norm
LO, HI, BETA = 0.2, 0.28, 0.05


def ref_kl(x, est, clamp, inverse=False):
    """k1 = x, k2 = x^2 / 2, k3 = e^-x - 1 + x with x = log pi - log pi_ref; clamped (verl's
    low_var_kl): x to [-20, 20], k3 to [-10, 10]. inverse (a mutation): k3 of r = pi / pi_ref."""
    if est == "k1":
        return x
    if est == "k2":
        return x * x / 2
    if inverse:
        x = -x
    if clamp:
        x = x.clamp(-20.0, 20.0)
        return (torch.exp(-x) - 1 + x).clamp(-10.0, 10.0)
    return torch.exp(-x) - 1 + x


def ref_aggregate(terms, mask, agg, norm=NORM, mutation=None):
    """terms[b][t] the loss of token t of row b (0-d tensors); only trained tokens count.
    token-mean: sum / tokens; seq-mean-token-mean: mean of row means; seq-mean-token-sum: mean of
    row sums; seq-mean-token-sum-norm: mean of row sums / C (Dr.GRPO with its constant)."""
    rows = [[terms[b][t] for t in range(T) if mask[b][t]] for b in range(len(mask))]
    if agg == "token-mean":
        return sum(sum(row) for row in rows if row) / sum(len(row) for row in rows)
    per_row = []
    for row in rows:
        s = sum(row) if row else 0.0
        if agg == "seq-mean-token-mean" or mutation == "ref:norm_is_the_row_length":
            per_row.append(s / max(len(row), 1))
        elif agg == "seq-mean-token-sum":
            per_row.append(s)
        else:
            per_row.append(s / norm)
    if mutation == "ref:norm_without_the_mean_over_rows":  # the batch summed, as one micro-batch of verl
        return sum(per_row)
    return sum(per_row) / len(rows)


def ref_clipped_loss(lp, batch, adv, agg, est, clamp, dual_c, mutation=None):
    """L_t = w_t * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), capped at -c A when A < 0
    (dual clip), + beta KL_t; then aggregated."""
    old, ref, mask, is_w = batch["old"], batch["ref"], batch["mask"].tolist(), batch["is_w"]
    hi = LO if mutation == "ref:symmetric_clip" else HI
    terms = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            a = (adv[b, t] if adv.dim() == 2 else adv[b]).item()
            ratio = torch.exp(lp[b, t] - old[b, t])
            term = torch.maximum(-a * ratio, -a * ratio.clamp(1 - LO, 1 + hi))
            if dual_c and (a < 0 or mutation == "ref:dual_clip_on_positive_advantages_too"):
                term = torch.minimum(term, torch.tensor(-dual_c * a, dtype=F64))
            x = lp[b, t] - ref[b, t]
            kl = ref_kl(x, est, clamp and mutation != "ref:unclamped_k3", mutation == "ref:k3_of_the_inverse_ratio")
            terms[b][t] = is_w[b, t].item() * term + BETA * kl
    return ref_aggregate(terms, mask, agg, mutation=mutation)


def _run(batch, impl, ref):
    """(loss, d loss / d logprobs) of titanrl's `impl(lp)` and of the reference `ref(lp)`."""
    out = []
    for fn in (impl, ref):
        lp = batch["lp"].clone().requires_grad_()
        loss = fn(lp)
        (grad,) = torch.autograd.grad(loss, lp)
        out.append((loss.detach(), grad))
    return [(out[0][0], out[1][0]), (out[0][1], out[1][1])]


CONFIGS = {  # estimator, clamp, dual-clip c, per-token advantages, planted KL log ratios
    "k3_clamped_dual3": ("k3", True, 3.0, False, (-3.0, 25.0, -800.0)),
    "k3_unclamped": ("k3", False, 0.0, True, (-3.0, 3.0, -2.0)),
    "k1_dual3": ("k1", True, 3.0, True, (-3.0, 25.0, -25.0)),
    "k2": ("k2", True, 0.0, False, (-3.0, 25.0, -25.0)),
}
LOSS_MUTATIONS = {
    "ref:no_dual_clip": None,
    "ref:dual_clip_on_positive_advantages_too": None,
    "ref:symmetric_clip": None,
    "ref:unclamped_k3": None,
    "ref:k3_of_the_inverse_ratio": None,
    "ref:norm_without_the_mean_over_rows": None,
    "ref:norm_is_the_row_length": None,
    "impl:k3_bound_100": lambda mp: mp.setattr(common, "K3_BOUND", 100.0),
    # The estimate's clamp alone keeps the value at 10, but exp(800) = inf gives a NaN gradient.
    "impl:no_log_ratio_clamp": lambda mp: mp.setattr(common, "K3_LOG_RATIO_BOUND", math.inf),
}


@pytest.mark.parametrize(
    "config,agg,mutation",
    [(c, a, None) for c in CONFIGS for a in AGGS]
    + [("k3_clamped_dual3", "seq-mean-token-sum-norm", m) for m in LOSS_MUTATIONS],
)
def test_clipped_pg_loss(config, agg, mutation, monkeypatch):
    est, clamp, dual_c, per_tok, extremes = CONFIGS[config]
    batch = ragged_batch(6, extremes)
    adv = batch["adv_BT"] if per_tok else batch["adv_B"]
    if callable(LOSS_MUTATIONS.get(mutation)):
        LOSS_MUTATIONS[mutation](monkeypatch)

    def impl(lp):
        return clipped_pg_loss(
            lp,
            batch["old"],
            adv,
            batch["mask"],
            clip_low=LO,
            clip_high=HI,
            loss_agg=agg,
            loss_agg_norm=NORM,
            num_global_tokens=batch["mask"].sum().item(),
            num_global_seqs=B,
            ref_logprobs_BT=batch["ref"],
            kl_coef=BETA,
            kl_estimator=est,
            kl_clamp=clamp,
            is_weights_BT=batch["is_w"],
            dual_clip_c=dual_c,
        ).loss

    ref_dual = 0.0 if mutation == "ref:no_dual_clip" else dual_c
    verdict(
        mutation, _run(batch, impl, lambda lp: ref_clipped_loss(lp, batch, adv, agg, est, clamp, ref_dual, mutation))
    )


def ref_gspo(lp, batch, adv, mutation=None):
    """Zheng et al. 2025 (arXiv:2507.18071): s_i = exp(1/|y_i| sum_t log(pi / pi_old)), loss per
    sequence max(-A s, -A clip(s)), mean over sequences (rows with no token contribute 0)."""
    old, mask = batch["old"], batch["mask"]
    total = 0.0
    for b in range(B):
        on = mask[b].bool()
        if not on.any():
            continue
        log_r = lp[b][on] - old[b][on]
        if mutation == "ref:token_level_ratio":  # PPO's per-token ratio, averaged over the row
            r = torch.exp(log_r)
            total = total + torch.maximum(-adv[b] * r, -adv[b] * r.clamp(1 - LO, 1 + HI)).mean()
            continue
        s = torch.exp(log_r.sum() if mutation == "ref:unnormalised_sequence_ratio" else log_r.mean())
        total = total + torch.maximum(-adv[b] * s, -adv[b] * s.clamp(1 - LO, 1 + HI))
    return total / B


@pytest.mark.parametrize("mutation", [None, "ref:token_level_ratio", "ref:unnormalised_sequence_ratio"])
def test_gspo_loss(mutation):
    batch = ragged_batch(7)
    batch["old"] = batch["lp"] + 0.05 * (batch["old"] - batch["lp"])  # sequence ratios near the clip range
    lo, hi = LO, HI

    def impl(lp):
        return gspo_loss(
            lp,
            batch["old"],
            batch["adv_B"],
            batch["mask"],
            clip_low=lo,
            clip_high=hi,
            num_global_tokens=batch["mask"].sum().item(),
            num_global_seqs=B,
        ).loss

    verdict(mutation, _run(batch, impl, lambda lp: ref_gspo(lp, batch, batch["adv_B"], mutation)))


def ref_cispo(lp, batch, adv, agg, mutation=None):
    """MiniMax 2025 (arXiv:2506.13585): L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)."""
    old, mask = batch["old"], batch["mask"].tolist()
    terms = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            a = adv[b, t].item()
            ratio = torch.exp(lp[b, t] - old[b, t])
            if mutation == "ref:ppo_clipped_surrogate":
                terms[b][t] = torch.maximum(-a * ratio, -a * ratio.clamp(1 - LO, 1 + HI))
                continue
            weight = ratio.clamp(1 - LO, 1 + HI)
            terms[b][t] = -(weight if mutation == "ref:weight_not_detached" else weight.detach()) * a * lp[b, t]
    return ref_aggregate(terms, mask, agg)


@pytest.mark.parametrize(
    "agg,mutation",
    [(a, None) for a in AGGS]
    + [("token-mean", "ref:weight_not_detached"), ("token-mean", "ref:ppo_clipped_surrogate")],
)
def test_cispo_loss(agg, mutation):
    batch = ragged_batch(8)

    def impl(lp):
        return cispo_loss(
            lp,
            batch["old"],
            batch["adv_BT"],
            batch["mask"],
            clip_low=LO,
            clip_high=HI,
            loss_agg=agg,
            loss_agg_norm=NORM,
            num_global_tokens=batch["mask"].sum().item(),
            num_global_seqs=B,
        ).loss

    verdict(mutation, _run(batch, impl, lambda lp: ref_cispo(lp, batch, batch["adv_BT"], agg, mutation)))


TAU_POS, TAU_NEG = 0.7, 3.1


def ref_sapo(lp, batch, adv, agg, mutation=None):
    """Gao et al. 2025 (arXiv:2511.20347): L_t = -sigmoid(tau (r_t - 1)) 4 / tau A_t, tau = tau_pos
    if A_t > 0 else tau_neg."""
    old, mask = batch["old"], batch["mask"].tolist()
    terms = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            a = adv[b].item()
            tau = TAU_POS if a > 0 else TAU_NEG
            if mutation == "ref:temperatures_swapped":
                tau = TAU_NEG if a > 0 else TAU_POS
            scale = 1.0 if mutation == "ref:no_4_over_tau" else 4.0 / tau
            terms[b][t] = -torch.sigmoid(tau * (torch.exp(lp[b, t] - old[b, t]) - 1)) * scale * a
    return ref_aggregate(terms, mask, agg)


@pytest.mark.parametrize(
    "agg,mutation",
    [(a, None) for a in AGGS]
    + [("seq-mean-token-mean", "ref:temperatures_swapped"), ("seq-mean-token-mean", "ref:no_4_over_tau")],
)
def test_sapo_loss(agg, mutation):
    batch = ragged_batch(9)

    def impl(lp):
        return sapo_loss(
            lp,
            batch["old"],
            batch["adv_B"],
            batch["mask"],
            tau_pos=TAU_POS,
            tau_neg=TAU_NEG,
            loss_agg=agg,
            loss_agg_norm=NORM,
            num_global_tokens=batch["mask"].sum().item(),
            num_global_seqs=B,
        ).loss

    verdict(mutation, _run(batch, impl, lambda lp: ref_sapo(lp, batch, batch["adv_B"], agg, mutation)))


@pytest.mark.parametrize("mutation", [None, "ref:min_of_the_two", "ref:no_clip"])
def test_ppo_value_loss(mutation):
    """L^V_t = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), token mean."""
    batch, eps = ragged_batch(10), 0.2
    v_old, ret, mask = batch["values"], batch["kl"] * 3 - 1, batch["mask"]

    def ref(v):
        total, n = 0.0, 0
        for b in range(B):
            for t in range(T):
                if mask[b, t]:
                    un = (v[b, t] - ret[b, t]) ** 2
                    cl = (v_old[b, t] + (v[b, t] - v_old[b, t]).clamp(-eps, eps) - ret[b, t]) ** 2
                    pick = {"ref:min_of_the_two": torch.minimum, "ref:no_clip": lambda u, c: u}.get(
                        mutation, torch.maximum
                    )
                    total, n = total + 0.5 * pick(un, cl), n + 1
        return total / n

    batch["lp"] = v_old + 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=F64)
    verdict(mutation, _run(batch, lambda v: value_loss(v, v_old, ret, mask, eps, mask.sum().item())[0], ref))


@pytest.mark.parametrize("mutation", [None, "ref:label_smoothing_sign", "ref:no_reference"])
def test_dpo_loss(mutation):
    """Rafailov et al. 2023 (arXiv:2305.18290), conservative DPO's label smoothing:
    L = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h), h = beta ((pi_w - ref_w) - (pi_l - ref_l))."""
    g = torch.Generator().manual_seed(11)
    pc, pr, rc, rr = (3 * torch.randn(8, generator=g, dtype=F64) for _ in range(4))
    beta, eps = 0.3, 0.1
    got = dpo_loss(pc, pr, rc, rr, beta, eps).loss_B
    want = []
    for i in range(8):
        ref_c, ref_r = (0.0, 0.0) if mutation == "ref:no_reference" else (rc[i].item(), rr[i].item())
        h = beta * ((pc[i].item() - ref_c) - (pr[i].item() - ref_r))
        e = -eps if mutation == "ref:label_smoothing_sign" else eps
        want.append(-(1 - e) * -math.log1p(math.exp(-h)) - e * -math.log1p(math.exp(h)))
    verdict(mutation, [(got, want)])

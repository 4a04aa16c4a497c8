"""Advantages and losses of RLOO, ReMax, REINFORCE++, PPO (GAE, value loss), GSPO, CISPO, SAPO, DAPO,
TIS/MIS and DPO, each against a float64 reference written independently here (plain Python loops)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.algorithms import ALGORITHMS, AdvantageInputs, LossInputs, get_algorithm, validate_algorithm
from titanrl.algorithms.cispo import cispo_loss
from titanrl.algorithms.common import clipped_pg_loss, importance_weights, masked_whiten, token_rewards
from titanrl.algorithms.dapo import informative_groups, overlong_penalty
from titanrl.algorithms.dpo import bradley_terry_loss, dpo_loss
from titanrl.algorithms.gspo import gspo_loss
from titanrl.algorithms.ppo import gae, value_loss
from titanrl.algorithms.reinforce_pp import discounted_returns, reinforce_pp_advantages
from titanrl.algorithms.remax import remax_advantages, remax_reward_to_go_advantages
from titanrl.algorithms.rloo import rloo_advantages
from titanrl.algorithms.sapo import sapo_loss
from titanrl.config import load_config
from titanrl.config.algorithm import Algorithm as AlgorithmConfig

# ---- RLOO ----


def test_rloo_matches_leave_one_out_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    got = rloo_advantages(r, 4).tolist()
    want = []
    for g in range(2):
        grp = r[4 * g : 4 * g + 4].double().tolist()
        want += [x - (sum(grp) - x) / 3 for x in grp]
    assert got == pytest.approx(want, abs=1e-7)
    assert got[4:] == [0.0] * 4  # all-equal rewards: no signal


def test_rloo_rejects_groups_of_one():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.tensor([1.0, 2.0]), 1)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=12, max_size=12), st.permutations(range(4)))
def test_rloo_is_invariant_to_group_order(rewards, perm):
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = rloo_advantages(r, 4).view(3, 4)
    adv_perm = rloo_advantages(r.view(3, 4)[:, list(perm)].reshape(-1), 4).view(3, 4)
    torch.testing.assert_close(adv_perm, adv[:, list(perm)], atol=1e-12, rtol=1e-12)


# ---- ReMax ----


@pytest.mark.parametrize("group_size", [1, 3])
def test_remax_subtracts_each_prompts_greedy_reward(group_size):
    rewards = [0.5, -1.0, 2.0, 0.0, 1.0, 1.0][: 2 * group_size]
    greedy = [0.25, 1.0]
    got = remax_advantages(torch.tensor(rewards), torch.tensor(greedy), group_size).tolist()
    want = [rewards[i] - greedy[i // group_size] for i in range(len(rewards))]
    assert got == pytest.approx(want, abs=1e-7)


def test_remax_rejects_baselines_that_do_not_match_the_groups():
    with pytest.raises(ValueError, match="greedy baselines"):
        remax_advantages(torch.zeros(6), torch.zeros(2), 2)


def _remax_reward_to_go_f64(rewards, greedy, G, mask, kl, beta):
    """A_t = r_i - beta * sum_{s >= t, masked} KL_s - r_greedy(prompt of i) on completion tokens."""
    out = []
    for i, (m_row, kl_row) in enumerate(zip(mask, kl)):
        row = [0.0] * len(m_row)
        for t in range(len(m_row)):
            if m_row[t]:
                future_kl = sum(kl_row[s] for s in range(t, len(m_row)) if m_row[s])
                row[t] = rewards[i] - beta * future_kl - greedy[i // G]
        out.append(row)
    return out


@pytest.mark.parametrize("G", [1, 2])
def test_remax_reward_to_go_matches_float64_reference(G):
    """verl's ReMax with the KL in the reward: per-token return of the token rewards minus the
    greedy reward; with the whole-sequence KL instead, every token of a row would get its first
    token's value."""
    g = torch.Generator().manual_seed(7)
    mask = MASK.double()
    rewards = torch.tensor([1.0, 0.3, -0.7, 2.0], dtype=torch.float64)
    greedy = torch.tensor([0.1, 0.9, 0.2, -0.4][: 4 // G], dtype=torch.float64)
    kl = torch.rand(4, 5, generator=g, dtype=torch.float64) * mask
    got = remax_reward_to_go_advantages(rewards, greedy, G, mask, kl, 0.1)
    want = _remax_reward_to_go_f64(rewards.tolist(), greedy.tolist(), G, mask.tolist(), kl.tolist(), 0.1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-14, rtol=1e-13)
    # The first completion token carries the whole sequence's KL: ReMax's "sequence" advantage.
    seq = remax_advantages(rewards - 0.1 * kl.sum(-1), greedy, G)
    for b, first in enumerate([1, 2, 0]):
        assert got[b, first].item() == pytest.approx(seq[b].item(), abs=1e-14)
    # Through the class: [algorithm.remax] kl_reward picks the estimator; float32 rewards stay float32.
    cfg = AlgorithmConfig(name="remax", group_size=G, kl_coef=0.1, kl_in_reward=True)
    inputs = AdvantageInputs(rewards.float(), MASK, kl.float(), None, None, greedy.float(), None)
    cfg.tables = {"remax": {"kl_reward": "reward_to_go"}}
    adv = ALGORITHMS["remax"](cfg).advantages(inputs).advantages
    assert adv.dtype == torch.float32 and adv.shape == (4, 5)
    torch.testing.assert_close(adv.double(), got, atol=1e-6, rtol=1e-6)
    cfg.tables = {}
    assert ALGORITHMS["remax"](cfg).advantages(inputs).advantages.shape == (4,)


def test_remax_reward_to_go_needs_the_kl_in_the_reward():
    with pytest.raises(ValueError, match=r"kl_reward = 'reward_to_go' .* set algorithm.kl_in_reward = true"):
        validate_algorithm(load_config(["--algorithm.name=remax", "--algorithm.remax.kl_reward=reward_to_go"]))
    validate_algorithm(
        load_config(
            [
                "--algorithm.name=remax",
                "--algorithm.remax.kl_reward=reward_to_go",
                "--algorithm.kl_in_reward=true",
                "--algorithm.kl_coef=0.01",
            ]
        )
    )


# ---- token rewards, returns, whitening, REINFORCE++ ----

MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]).float()


def test_token_rewards_put_score_on_last_token_and_kl_everywhere():
    kl = torch.full_like(MASK, 0.5)
    r = token_rewards(torch.tensor([1.0, -2.0, 3.0, 7.0]), MASK, kl, kl_coef=0.1)
    assert r[0].tolist() == pytest.approx([0, -0.05, -0.05, 0.95, 0])
    assert r[1].tolist() == pytest.approx([0, 0, -2.05, 0, 0])
    assert r[2].tolist() == pytest.approx([-0.05] * 4 + [2.95])
    assert r[3].tolist() == [0.0] * 5  # no completion token: the score has nowhere to go


def test_token_rewards_place_per_turn_rewards_at_the_end_of_each_turn():
    # Row 0: two model turns (tokens 1-2 and 5), environment tokens 3-4 masked out.
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]).float()
    r = token_rewards(
        torch.zeros(3), mask, torch.full_like(mask, 1.0), 0.1, turn_scores=[[0.5, 2.0], [1.0, 3.0], [4.0]]
    )
    assert r[0].tolist() == pytest.approx([0, -0.1, 0.4, 0, 0, 1.9, 0])
    assert r[1].tolist() == pytest.approx([-0.1, -0.1, -0.1, 3.9, 0, 0, 0])  # surplus on the last turn
    assert r[2].tolist() == [0.0] * 7  # no model token: nowhere to put it


def _returns_f64(rewards, mask, gamma):
    out = []
    for r_row, m_row in zip(rewards, mask):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def test_discounted_returns_and_reinforce_pp_whitening():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=g) * MASK
    want = _returns_f64(rewards.double().tolist(), MASK.tolist(), 0.9)
    got = discounted_returns(rewards, MASK, 0.9)
    assert got.tolist() == [pytest.approx(row, abs=1e-6) for row in want]
    # REINFORCE++ advantages: returns whitened over every masked token of the batch.
    scores = torch.tensor([1.0, 0.0, 2.0, 5.0])
    kl = torch.randn(4, 5, generator=g)
    adv = reinforce_pp_advantages(scores, MASK, kl, 0.05, 1.0)
    returns = _returns_f64(token_rewards(scores, MASK, kl, 0.05).double().tolist(), MASK.tolist(), 1.0)
    flat = [x for row, m in zip(returns, MASK.tolist()) for x, mm in zip(row, m) if mm]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    for b in range(4):
        for t in range(5):
            want_bt = (returns[b][t] - mean) / std if MASK[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(want_bt, abs=1e-5)


def _whiten_f64(values, mask):
    """(x - mean) / (std + 1e-8) over the masked entries, population std (titanrl's estimator)."""
    flat = [x for row, m in zip(values, mask) for x, mm in zip(row, m) if mm]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    return [[(x - mean) / (std + 1e-8) if mm else 0.0 for x, mm in zip(row, m)] for row, m in zip(values, mask)]


def _reinforce_pp_baseline_f64(scores, mask, kl, beta, gamma, G):
    """REINFORCE++-baseline from its definition: s'_i = s_i - mean(s of i's group), token rewards
    -beta * KL_t with s'_i on the last completion token, discounted returns, global whitening."""
    centred = [s - sum(scores[i // G * G : i // G * G + G]) / G for i, s in enumerate(scores)]
    rewards = []
    for i, (m_row, kl_row) in enumerate(zip(mask, kl)):
        row = [-beta * k if m else 0.0 for k, m in zip(kl_row, m_row)]
        last = max((t for t, m in enumerate(m_row) if m), default=None)
        if last is not None:
            row[last] += centred[i]
        rewards.append(row)
    return _whiten_f64(_returns_f64(rewards, mask, gamma), mask)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_reinforce_pp_baseline_matches_float64_reference(gamma, beta):
    g = torch.Generator().manual_seed(9)
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1],
            [1, 1, 0, 1, 1, 0],
            [0, 0, 0, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 1, 1, 0, 0, 0],
        ]
    ).double()  # ragged, with a hole (row 2: an environment token)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.7, 0.7, 0.7], dtype=torch.float64)  # G = 3; the second group all equal
    kl = torch.rand(6, 6, generator=g, dtype=torch.float64) * mask
    got = reinforce_pp_advantages(scores, mask, kl, beta, gamma, baseline_group_size=3)
    want = _reinforce_pp_baseline_f64(scores.tolist(), mask.tolist(), kl.tolist(), beta, gamma, 3)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=1e-12)
    # Without the baseline it is plain REINFORCE++, which differs.
    plain = reinforce_pp_advantages(scores, mask, kl, beta, gamma)
    assert (plain - got).abs().max() > 0.1
    # Through the class, with [algorithm.reinforce_pp] baseline = "group".
    cfg = AlgorithmConfig(name="reinforce_pp", group_size=3, kl_coef=beta, kl_in_reward=beta > 0)
    cfg.tables = {"reinforce_pp": {"baseline": "group", "gamma": gamma}}
    inputs = AdvantageInputs(scores, mask, kl if beta else None, None, None, None, None)
    torch.testing.assert_close(ALGORITHMS["reinforce_pp"](cfg).advantages(inputs).advantages, got)


def test_reinforce_pp_baseline_multi_turn_takes_the_group_mean_off_the_last_turn():
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]]).double()
    turns = [[0.5, 1.5], [1.0]]  # totals 2.0 and 1.0, group mean 1.5
    got = reinforce_pp_advantages(torch.tensor([2.0, 1.0]), mask, None, 0.0, 1.0, None, turns, baseline_group_size=2)
    # Turn rewards less the group mean on the last turn: row 0 [0.5, 1.5 - 1.5] on tokens 1 and 3, row 1
    # [1.0 - 1.5] on token 0; returns [0.5, 0.5, -, 0] and [-0.5].
    want = _whiten_f64([[0.5, 0.5, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0]], mask.tolist())
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_reinforce_pp_baseline_needs_groups():
    with pytest.raises(ValueError, match=r"baseline = 'group' needs algorithm.group_size >= 2"):
        validate_algorithm(
            load_config(
                ["--algorithm.name=reinforce_pp", "--algorithm.group_size=1", "--algorithm.reinforce_pp.baseline=group"]
            )
        )
    with pytest.raises(ValueError, match=r"expected one of 'none', 'group'"):
        validate_algorithm(load_config(["--algorithm.name=reinforce_pp", "--algorithm.reinforce_pp.baseline=grp"]))


def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = masked_whiten(x, m)
    std = math.sqrt(1.25)
    assert w.tolist() == [pytest.approx([-1.5 / std, -0.5 / std, 0.0]), pytest.approx([0.5 / std, 1.5 / std, 0.0])]


# ---- GAE and value loss ----


def _gae_f64(rewards, values, mask, gamma, lam):
    """The textbook reverse loop over each row's masked-in tokens only."""
    adv_out, ret_out = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        idx = [t for t, m in enumerate(m_row) if m]
        adv = [0.0] * len(r_row)
        ret = [0.0] * len(r_row)
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v_row[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r_row[t] + gamma * next_v - v_row[t]
            last = delta + gamma * lam * last
            adv[t] = last
            ret[t] = last + v_row[t]
        adv_out.append(adv)
        ret_out.append(ret)
    return adv_out, ret_out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_gae_matches_reverse_loop_reference(B, T, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    # Arbitrary masks, holes included (multi-turn: observation tokens inside a completion).
    mask = (torch.rand(B, T, generator=g) > 0.35).double()
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = _gae_f64(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64), atol=1e-10, rtol=1e-10)


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.9]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert ret.tolist() == [pytest.approx([1.0, 1.0, 1.0])]
    assert adv.tolist() == [pytest.approx([0.8, 0.5, 0.1])]


def test_value_loss_clipping_by_hand():
    v = torch.tensor([[1.0, 0.0, 3.0]])
    old = torch.tensor([[0.5, 0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, n_clipped = value_loss(v, old, ret, mask, clip=0.2, num_global_tokens=2)
    # token 0: unclipped (1-2)^2 = 1, clipped v = 0.7 -> (0.7-2)^2 = 1.69 (chosen); token 1: 1 vs 1.
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert n_clipped.item() == 1
    unclipped, _ = value_loss(v, old, ret, mask, clip=0.0, num_global_tokens=2)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)


# ---- GSPO ----


def test_gspo_loss_and_gradient_match_sequence_level_reference():
    g = torch.Generator().manual_seed(3)
    B, T = 3, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]]).float()
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = lp.detach() + 0.01 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lo, hi = 3e-3, 4e-3
    out = gspo_loss(
        lp, old, adv, mask.double(), clip_low=lo, clip_high=hi, num_global_tokens=mask.sum().item(), num_global_seqs=B
    )
    # Reference: the sequence-level objective written directly.
    lp_ref = lp.detach().clone().requires_grad_()
    terms = []
    for b in range(B):
        m = mask[b].bool()
        s = torch.exp((lp_ref[b][m] - old[b][m]).mean())
        terms.append(torch.maximum(-adv[b] * s, -adv[b] * s.clamp(1 - lo, 1 + hi)))
    ref = torch.stack(terms).mean()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-10)
    out.loss.backward()
    ref.backward()
    torch.testing.assert_close(lp.grad * mask, lp_ref.grad * mask, atol=1e-12, rtol=1e-9)
    assert out.clipped_tokens.item() > 0  # ratios ~1 +- 1% are outside a 3e-3 clip range


# ---- TIS / MIS ----


def test_importance_weights_truncate_and_mask():
    old = torch.log(torch.tensor([[1.0, 3.0, 0.2, 1.5]]))
    gen = torch.zeros(1, 4)
    w, dropped = importance_weights(old, gen, "tis", cap=2.0)
    assert w.tolist() == [pytest.approx([1.0, 2.0, 0.2, 1.5])] and dropped.tolist() == [[False, True, False, False]]
    w, dropped = importance_weights(old, gen, "mis", cap=2.0)
    assert w.tolist() == [pytest.approx([1.0, 0.0, 0.0, 1.5])] and dropped.tolist() == [[False, True, True, False]]
    w, dropped = importance_weights(old, gen, "none", cap=2.0)
    assert w.tolist() == [[1.0] * 4] and not dropped.any()


def test_tis_weights_scale_the_per_token_loss():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w = torch.tensor([[0.5, 2.0]])
    out = clipped_pg_loss(
        lp,
        lp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        num_global_tokens=2,
        num_global_seqs=1,
        is_weights_BT=w,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert lp.grad.tolist() == [pytest.approx([-0.25, -1.0])]


# ---- DAPO ----


def test_informative_groups_and_overlong_penalty():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    assert informative_groups(r, 2).tolist() == [False, True, False, False]
    lengths = torch.tensor([10, 12, 14, 16, 17])
    # L_max 16, buffer 4: safe up to 12, then linear to -1 at 16, -1 beyond.
    assert overlong_penalty(lengths, 16, 4, factor=1.0).tolist() == pytest.approx([0, 0, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5


# ---- DPO and reward-model losses ----


def test_dpo_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(5)
    pc, pr, rc, rr = (torch.randn(6, generator=g) * 3 for _ in range(4))
    for beta, eps in [(0.1, 0.0), (0.5, 0.1)]:
        out = dpo_loss(pc, pr, rc, rr, beta, eps)
        for i in range(6):
            h = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
            want = -(1 - eps) * math.log(1 / (1 + math.exp(-h))) - eps * math.log(1 / (1 + math.exp(h)))
            assert out.loss_B[i].item() == pytest.approx(want, rel=1e-5)
            assert out.chosen_reward_B[i].item() == pytest.approx(beta * (pc[i] - rc[i]).item(), rel=1e-5)
    bt = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0]))
    assert bt.tolist() == pytest.approx([math.log(1 + math.exp(-2)), math.log(1 + math.exp(2))])


# ---- CISPO and SAPO: float64 references (plain loops over tokens, autograd through each term) ----

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _aggregate_f64(terms, mask, agg):
    """terms[b][t] is token t's loss (a 0-d tensor); only masked-in tokens count."""
    n_tokens = sum(m for row in mask for m in row)
    total = 0.0
    for b, row in enumerate(mask):
        kept = [terms[b][t] for t, m in enumerate(row) if m]
        if agg == "token-mean":
            total = total + sum(kept) / n_tokens
        elif agg == "seq-mean-token-mean":
            total = total + (sum(kept) / len(kept) if kept else 0.0) / len(mask)
        else:
            total = total + sum(kept) / len(mask)
    return total


def _k3_f64(lp, ref):
    return torch.exp(ref - lp) - 1.0 + (lp - ref)


def _random_case(seed, per_token_adv):
    """Logprobs with ratios far enough from 1 to leave any clip range, a reference, IS weights."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 2
    old = lp + 0.5 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = (
        torch.randn(4, 5, generator=g, dtype=torch.float64)
        if per_token_adv
        else torch.tensor([1.5, -0.7, 0.0, 2.0], dtype=torch.float64)
    )
    is_w = 0.5 + 1.5 * torch.rand(4, 5, generator=g, dtype=torch.float64)
    return lp, old, ref, adv, is_w


def _check_value_and_grad(out, ref_loss, lp, lp_ref):
    """Loss and d loss / d logprobs agree with the reference to float64 rounding."""
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12)
    out.loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-12, rtol=1e-9)


def _cispo_ref(lp_ref, old, adv, ref, is_w, mask, agg, lo, hi, beta):
    terms = [[None] * lp_ref.shape[1] for _ in range(lp_ref.shape[0])]
    for b in range(lp_ref.shape[0]):
        for t in range(lp_ref.shape[1]):
            a = adv[b, t].item() if adv.dim() == 2 else adv[b].item()
            ratio = math.exp(lp_ref[b, t].item() - old[b, t].item())  # a float: no gradient flows
            weight = min(max(ratio, 1 - lo), 1 + hi)
            terms[b][t] = -weight * a * lp_ref[b, t] * is_w[b, t].item() + beta * _k3_f64(lp_ref[b, t], ref[b, t])
    return _aggregate_f64(terms, mask.tolist(), agg)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_cispo_loss_and_gradient_match_float64_reference(agg, per_token_adv):
    lp0, old, ref, adv, is_w = _random_case(11, per_token_adv)
    lo, hi, beta = 0.2, 0.28, 0.1
    lp, lp_ref = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    out = cispo_loss(
        lp,
        old,
        adv,
        MASK.double(),
        clip_low=lo,
        clip_high=hi,
        loss_agg=agg,
        num_global_tokens=MASK.sum().item(),
        num_global_seqs=4,
        ref_logprobs_BT=ref,
        kl_coef=beta,
        kl_estimator="k3",
        is_weights_BT=is_w,
    )
    _check_value_and_grad(out, _cispo_ref(lp_ref, old, adv, ref, is_w, MASK, agg, lo, hi, beta), lp, lp_ref)
    ratio = torch.exp(lp0 - old)
    assert out.clipped_tokens.item() == (((ratio < 1 - lo) | (ratio > 1 + hi)).double() * MASK).sum().item() > 0
    assert out.ratio_max.item() == pytest.approx((ratio * MASK).max().item())


def test_cispo_keeps_the_gradient_of_a_token_past_the_clip_and_caps_its_weight():
    # One token with ratio 2 > 1 + eps_high and A = 1, one on-policy token with A = -1.
    lp = torch.log(torch.tensor([[0.5, 0.3]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.3]], dtype=torch.float64))
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    kw = dict(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", num_global_tokens=2, num_global_seqs=1)
    out = cispo_loss(lp, old, adv, mask, **kw)
    out.loss.backward()
    # d/d logp of -sg(w) A logp / 2: the weight is capped at 1 + 0.28, not 2, and not zeroed.
    assert lp.grad.tolist() == [pytest.approx([-1.28 / 2, 1.0 / 2])]
    assert out.clipped_tokens.item() == 1
    # PPO's clipped surrogate drops the same token's gradient entirely.
    lp_ppo = lp.detach().clone().requires_grad_()
    clipped_pg_loss(lp_ppo, old, adv, mask, **kw).loss.backward()
    assert lp_ppo.grad[0, 0].item() == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=6, max_size=6),
    st.lists(st.floats(-2, 2, allow_subnormal=False), min_size=6, max_size=6),
    st.floats(0.0, 2.0),
    st.floats(0.0, 1.0),
)
def test_cispo_every_token_gets_its_clipped_weight_times_advantage(log_ratios, advs, lo, hi):
    """Property: d loss / d logp_t = -clip(r_t) A_t / N for every token, so no token with A_t != 0
    ever loses its gradient (the clipped weight is >= max(1 - eps_low, 0) and positive)."""
    log_r = torch.tensor([log_ratios], dtype=torch.float64)
    lp = torch.full((1, 6), -1.0, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([advs], dtype=torch.float64)
    out = cispo_loss(
        lp,
        lp.detach() - log_r,
        adv,
        torch.ones(1, 6, dtype=torch.float64),
        clip_low=lo,
        clip_high=hi,
        loss_agg="token-mean",
        num_global_tokens=6,
        num_global_seqs=1,
    )
    out.loss.backward()
    for t in range(6):
        weight = min(max(math.exp(log_ratios[t]), 1 - lo), 1 + hi)
        assert lp.grad[0, t].item() == pytest.approx(-weight * advs[t] / 6, rel=1e-9, abs=1e-15)
        assert weight > 0 and (advs[t] == 0 or lp.grad[0, t].item() != 0)


def _sapo_ref(lp_ref, old, adv, ref, is_w, mask, agg, tau_pos, tau_neg, beta):
    terms = [[None] * lp_ref.shape[1] for _ in range(lp_ref.shape[0])]
    for b in range(lp_ref.shape[0]):
        for t in range(lp_ref.shape[1]):
            a = adv[b, t].item() if adv.dim() == 2 else adv[b].item()
            tau = tau_pos if a > 0 else tau_neg
            ratio = torch.exp(lp_ref[b, t] - old[b, t])
            gate = 4.0 / tau / (1.0 + torch.exp(-tau * (ratio - 1.0)))
            terms[b][t] = -gate * a * is_w[b, t].item() + beta * _k3_f64(lp_ref[b, t], ref[b, t])
    return _aggregate_f64(terms, mask.tolist(), agg)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_sapo_loss_and_gradient_match_float64_reference(agg, per_token_adv):
    lp0, old, ref, adv, is_w = _random_case(12, per_token_adv)
    tau_pos, tau_neg, beta = 0.7, 3.1, 0.1  # far apart, so that a swap of the two would show
    lp, lp_ref = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    out = sapo_loss(
        lp,
        old,
        adv,
        MASK.double(),
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        loss_agg=agg,
        num_global_tokens=MASK.sum().item(),
        num_global_seqs=4,
        ref_logprobs_BT=ref,
        kl_coef=beta,
        kl_estimator="k3",
        is_weights_BT=is_w,
    )
    _check_value_and_grad(out, _sapo_ref(lp_ref, old, adv, ref, is_w, MASK, agg, tau_pos, tau_neg, beta), lp, lp_ref)
    assert out.ratio_max.item() == pytest.approx((torch.exp(lp0 - old) * MASK).max().item())


def _sapo_token_grad(log_ratio, adv, tau_pos, tau_neg):
    """d loss / d logp of one token with ratio exp(log_ratio) and advantage adv."""
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    out = sapo_loss(
        lp,
        lp.detach() - log_ratio,
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        loss_agg="token-mean",
        num_global_tokens=1,
        num_global_seqs=1,
    )
    out.loss.backward()
    return lp.grad.item(), out


@settings(max_examples=60, deadline=None)
@given(st.floats(0.05, 20.0), st.floats(0.05, 20.0), st.floats(-3.0, 3.0).filter(lambda a: abs(a) > 1e-3))
def test_sapo_on_policy_gradient_is_the_policy_gradient(tau_pos, tau_neg, adv):
    """At r = 1 the gate's slope is 1 whatever tau: the gradient is -A grad log pi, the unclipped
    policy gradient (which the clipped surrogate also has at r = 1)."""
    grad, _ = _sapo_token_grad(0.0, adv, tau_pos, tau_neg)
    assert grad == pytest.approx(-adv, rel=1e-12)
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    clipped_pg_loss(
        lp,
        lp.detach(),
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        num_global_tokens=1,
        num_global_seqs=1,
    ).loss.backward()
    assert grad == pytest.approx(lp.grad.item(), rel=1e-12)


def test_sapo_gate_decays_away_from_ratio_one():
    # d loss / d logp = -4 s (1 - s) r A with s = sigmoid(tau (r - 1)): smooth, largest near r = 1.
    for adv in (1.0, -1.0):
        grads = {r: abs(_sapo_token_grad(math.log(r), adv, 1.0, 1.05)[0]) for r in (1e-3, 0.5, 1.0, 4.0, 10.0, 30.0)}
        assert grads[1.0] == pytest.approx(1.0)
        assert grads[10.0] < 0.01 and grads[30.0] < 1e-9 and grads[1e-3] < 0.01
        assert grads[30.0] < grads[10.0] < grads[4.0]
        assert all(g > 0 for g in grads.values())  # attenuated, never cut off
    # A ratio of 4 has been damped past half of its importance-weighted gradient (w = 4 s (1 - s)).
    _, out = _sapo_token_grad(math.log(4.0), 1.0, 1.0, 1.05)
    assert out.clipped_tokens.item() == 1
    _, out = _sapo_token_grad(math.log(1.5), 1.0, 1.0, 1.05)
    assert out.clipped_tokens.item() == 0


@settings(max_examples=60, deadline=None)
@given(st.floats(-3.0, 1.5).filter(lambda x: abs(x) > 1e-2), st.floats(0.1, 3.0), st.floats(1.01, 3.0))
def test_sapo_negative_advantages_decay_faster_with_a_larger_tau_neg(log_ratio, tau_pos, factor):
    """tau_neg > tau_pos: off-policy (r != 1) a negative-advantage token's gradient is smaller than
    a positive one's of the same |A|; on-policy they are equal; the loss uses tau by sign of A."""
    tau_neg = tau_pos * factor
    grad_pos, out_pos = _sapo_token_grad(log_ratio, 1.0, tau_pos, tau_neg)
    grad_neg, out_neg = _sapo_token_grad(log_ratio, -1.0, tau_pos, tau_neg)
    assert grad_pos < 0 < grad_neg and abs(grad_neg) < abs(grad_pos)
    r = math.exp(log_ratio)
    assert out_pos.loss.item() == pytest.approx(-4 / tau_pos / (1 + math.exp(-tau_pos * (r - 1))), rel=1e-12)
    assert out_neg.loss.item() == pytest.approx(4 / tau_neg / (1 + math.exp(-tau_neg * (r - 1))), rel=1e-12)
    assert _sapo_token_grad(0.0, -1.0, tau_pos, tau_neg)[0] == pytest.approx(
        -_sapo_token_grad(0.0, 1.0, tau_pos, tau_neg)[0]
    )


def test_cispo_and_sapo_are_registered_and_read_their_config():
    lp0, old, ref, adv, is_w = _random_case(13, False)
    cfg = AlgorithmConfig(clip_eps_low=1.0, clip_eps_high=0.1, loss_agg="seq-mean-token-sum")
    cfg.tables = {"sapo": {"tau_pos": 0.5, "tau_neg": 2.0}}
    inputs = LossInputs(lp0, old, adv, MASK.double(), num_global_tokens=MASK.sum().item(), num_global_seqs=4)
    got = ALGORITHMS["cispo"](dataclasses.replace(cfg, tables={})).loss(inputs).loss.item()
    want = _cispo_ref(lp0, old, adv, ref, torch.ones_like(is_w), MASK, "seq-mean-token-sum", 1.0, 0.1, 0.0)
    assert got == pytest.approx(want.item(), rel=1e-10)
    got = ALGORITHMS["sapo"](cfg).loss(inputs).loss.item()
    want = _sapo_ref(lp0, old, adv, ref, torch.ones_like(is_w), MASK, "seq-mean-token-sum", 0.5, 2.0, 0.0)
    assert got == pytest.approx(want.item(), rel=1e-10)
    for name in ("tau_pos", "tau_neg"):
        with pytest.raises(ValueError, match=rf"\[algorithm.sapo\] {name} must be > 0"):
            validate_algorithm(load_config(["--algorithm.name=sapo", f"--algorithm.sapo.{name}=0"]))


# ---- shared options: dual clip, k3 clamp, seq-mean-token-sum-norm, from [algorithm] to the loss ----


def test_shared_loss_options_reach_every_clipped_surrogate_algorithm():
    """[algorithm] dual_clip_c, kl_clamp, loss_agg / loss_agg_norm reach `Algorithm.loss` and the
    losses of CISPO and SAPO (the aggregation and the KL clamp); the recipe's KL (`Algorithm.kl`)
    uses the same estimator and clamp."""
    lp, old, ref, adv, _ = _random_case(21, False)
    old, ref = old.clone(), ref.clone()
    old[1, 2] = lp[1, 2] - 2.0  # ratio e^2 > 3 with A < 0: dual-clipped
    ref[0, 1] = lp[0, 1] + 4.0  # k3 = e^4 - 5 > 10: clamped
    counts = dict(num_global_tokens=MASK.sum().item(), num_global_seqs=4)
    base = dict(kl_coef=0.1, loss_agg="seq-mean-token-sum-norm", loss_agg_norm=5)

    def through_config(name, **options):
        algo = ALGORITHMS[name](AlgorithmConfig(name=name, **base, **options))
        return algo.loss(LossInputs(lp, old, adv, MASK.double(), **counts, ref_logprobs_BT=ref))

    own = {"grpo": dict(clip_low=0.2, clip_high=0.2), "cispo": dict(clip_low=0.2, clip_high=0.2)}
    own["sapo"] = dict(tau_pos=1.0, tau_neg=1.05)
    for name, fn in [("grpo", clipped_pg_loss), ("cispo", cispo_loss), ("sapo", sapo_loss)]:
        for dual_c, clamp in [(0.0, True), (3.0, True), (0.0, False)]:
            if dual_c and name != "grpo":
                continue
            extra = {**own[name], **({"dual_clip_c": dual_c} if name == "grpo" else {})}
            want = fn(lp, old, adv, MASK.double(), kl_clamp=clamp, ref_logprobs_BT=ref, **counts, **base, **extra)
            got = through_config(name, dual_clip_c=dual_c, kl_clamp=clamp)
            assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-14), (name, dual_c, clamp)
        clamped, unclamped = through_config(name).loss.item(), through_config(name, kl_clamp=False).loss.item()
        assert clamped != pytest.approx(unclamped, rel=1e-6), name
    with_dual, without = through_config("grpo", dual_clip_c=3.0), through_config("grpo")
    assert with_dual.loss.item() < without.loss.item() and with_dual.clipped_tokens > without.clipped_tokens
    assert ALGORITHMS["grpo"](AlgorithmConfig()).kl(lp, ref).max().item() == 10.0
    assert ALGORITHMS["grpo"](AlgorithmConfig(kl_clamp=False)).kl(lp, ref).max().item() > 10.0


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--algorithm.dual_clip_c=0.5"], r"dual_clip_c must be 0 \(off\) or > 1 \(verl's default is 3.0\)"),
        (["--algorithm.loss_agg_norm=-1"], r"loss_agg_norm must be >= 0"),
        (["--algorithm.loss_agg_norm=512"], r"loss_agg_norm is only read by loss_agg = 'seq-mean-token-sum-norm'"),
        (["--algorithm.name=gspo", "--algorithm.dual_clip_c=3"], r"dual_clip_c caps the clipped surrogate.*'gspo'"),
        (["--algorithm.name=cispo", "--algorithm.dual_clip_c=3"], r"which 'cispo' does not use: set dual_clip_c = 0"),
        (["--algorithm.name=sapo", "--algorithm.dual_clip_c=3"], r"which 'sapo' does not use"),
        (["--algorithm.kl_clamp=sometimes"], r"Invalid value 'sometimes' for 'algorithm.kl_clamp'"),
    ],
)
def test_new_options_reject_bad_values(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_algorithm(load_config(args))


def test_loss_agg_norm_zero_is_the_maximum_response_length():
    config = load_config(["--algorithm.loss_agg=seq-mean-token-sum-norm", "--generator.max_new_tokens=48"])
    validate_algorithm(config)
    assert config.algorithm.loss_agg_norm == 48
    config = load_config(
        [
            "--algorithm.loss_agg=seq-mean-token-sum-norm",
            "--data.task=calculator",
            "--env.name=calculator",
            "--env.max_total_tokens=300",
        ]
    )
    validate_algorithm(config)
    assert config.algorithm.loss_agg_norm == 300
    config = load_config(["--algorithm.loss_agg=seq-mean-token-sum-norm", "--algorithm.loss_agg_norm=1024"])
    validate_algorithm(config)
    assert config.algorithm.loss_agg_norm == 1024
    defaults = load_config([])
    validate_algorithm(defaults)
    assert (defaults.algorithm.loss_agg_norm, defaults.algorithm.dual_clip_c, defaults.algorithm.kl_clamp) == (
        0,
        0.0,
        True,
    )


# ---- the loss contract: a user's policy term, the rest applied once by Algorithm.loss ----


@pytest.mark.parametrize("agg", AGGS)
def test_user_policy_term_gets_importance_weights_kl_and_aggregation(agg):
    """A plug-in that writes only `policy_term` (helpers.plugin_algorithms:PlainPG, loaded as
    `algorithm.name` loads it) trains on w_t * term_t + beta * k3_t, aggregated as configured,
    against a float64 loop; its own "clipped" count and the sequence of ratios come back too."""
    cls = get_algorithm("helpers.plugin_algorithms:PlainPG")
    lp0, old, ref, adv, is_w = _random_case(31, False)
    cfg = AlgorithmConfig(name=cls.name, kl_coef=0.05, loss_agg=agg, tables={"plain_pg": {"max_ratio": 1.1}})
    lp, lp_ref = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    inputs = LossInputs(lp, old, adv, MASK.double(), MASK.sum().item(), 4, ref_logprobs_BT=ref, is_weights_BT=is_w)
    out = cls(cfg).loss(inputs)
    terms = [[None] * 5 for _ in range(4)]
    for b in range(4):
        for t in range(5):
            ratio = torch.exp(lp_ref[b, t] - old[b, t])
            term = -adv[b].item() * torch.clamp(ratio, max=1.1)
            terms[b][t] = is_w[b, t].item() * term + 0.05 * _k3_f64(lp_ref[b, t], ref[b, t])
    _check_value_and_grad(out, _aggregate_f64(terms, MASK.tolist(), agg), lp, lp_ref)
    capped = (torch.exp(lp0 - old) > 1.1) & (MASK > 0)
    assert out.clipped_tokens.item() == capped.sum().item() > 0
    assert out.ratio_max.item() == pytest.approx((torch.exp(lp0 - old) * MASK).max().item(), rel=1e-15)
    with pytest.raises(ValueError, match=r"max_ratio must be > 1"):
        cls.read_settings(AlgorithmConfig(name=cls.name, tables={"plain_pg": {"max_ratio": 1.0}}))


def test_loss_spec_leaves_the_kl_out_of_the_loss_when_it_is_in_the_reward():
    lp, old, ref, adv, _ = _random_case(32, False)
    inputs = LossInputs(lp, old, adv, MASK.double(), MASK.sum().item(), 4, ref_logprobs_BT=ref)
    in_loss = ALGORITHMS["grpo"](AlgorithmConfig(kl_coef=0.1)).loss(inputs)
    in_reward = ALGORITHMS["grpo"](AlgorithmConfig(kl_coef=0.1, kl_in_reward=True)).loss(inputs)
    assert in_loss.kl_sum.item() > 0 and in_reward.kl_sum.item() == 0.0
    assert in_reward.loss.item() == pytest.approx(in_loss.loss.item() - 0.1 * in_loss.kl_sum.item() / MASK.sum().item())

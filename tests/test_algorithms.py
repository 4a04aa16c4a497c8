"""Advantages and losses of RLOO, ReMax, REINFORCE++, PPO (GAE, value loss), GSPO, DAPO, TIS/MIS and
DPO, each against a float64 reference written independently here (plain Python loops)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.algorithms.common import clipped_pg_loss, importance_weights, masked_whiten, token_rewards
from titanrl.algorithms.dapo import informative_groups, overlong_penalty
from titanrl.algorithms.dpo import bradley_terry_loss, dpo_loss
from titanrl.algorithms.gspo import gspo_loss
from titanrl.algorithms.ppo import gae, value_loss
from titanrl.algorithms.reinforce_pp import discounted_returns, reinforce_pp_advantages
from titanrl.algorithms.remax import remax_advantages
from titanrl.algorithms.rloo import rloo_advantages


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
    torch.testing.assert_close(adv_perm, adv[:, list(perm)].float(), atol=1e-5, rtol=1e-5)


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
    r = token_rewards(torch.zeros(3), mask, torch.full_like(mask, 1.0), 0.1, turn_scores=[[0.5, 2.0], [1.0, 3.0], [4.0]])
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
    st.integers(1, 4), st.integers(1, 7), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1),
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
    out = gspo_loss(lp, old, adv, mask.double(), clip_low=lo, clip_high=hi, num_global_tokens=mask.sum().item(),
                    num_global_seqs=B)
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
    out = clipped_pg_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2,
                          loss_agg="token-mean", num_global_tokens=2, num_global_seqs=1, is_weights_BT=w)
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

"""GRPO advantages and loss against hand-computed values and an independent float64 reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.algorithms import ALGORITHMS, AdvantageInputs
from titanrl.algorithms.common import aggregate, clipped_pg_loss, group_centred, kl_estimate
from titanrl.algorithms.grpo import group_advantages
from titanrl.algorithms.rloo import rloo_advantages
from titanrl.config.algorithm import Algorithm as AlgorithmConfig
from titanrl.data.batch import build_sequence_batch, split_batch


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # Group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> 0.
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    assert group_advantages(r, 4, normalize_std=True).tolist() == pytest.approx(expected, rel=1e-5)
    assert group_advantages(r, 4, normalize_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # Groups of size 1 have no baseline but themselves: advantage 0.
    assert group_advantages(r, 1, normalize_std=True).tolist() == [0.0] * 8
    with pytest.raises(ValueError, match="do not form groups of 3"):
        group_advantages(r, 3, normalize_std=True)


# ---- groups of equal rewards: exactly zero advantage (the float32 rounding bug) ----

EQUAL_VALUES = [0.1, 0.3, 0.7, 1 / 3, -2.2, 123.456]  # the property test below draws any float
GROUP_ALGORITHMS = ["grpo", "gspo", "cispo", "sapo", "rloo"]  # every algorithm whose baseline is its group's


def _group_baseline_advantages(rewards_N, G):
    """Every group-baseline advantage titanrl computes, by name."""
    out = {
        "grpo": group_advantages(rewards_N, G, normalize_std=True),
        "dr_grpo": group_advantages(rewards_N, G, normalize_std=False),
        "rloo": rloo_advantages(rewards_N, G),
        # float64 by design; REINFORCE++-baseline casts it to the rewards' dtype as here.
        "reinforce_pp_baseline (centred scores)": group_centred(rewards_N, G).to(rewards_N.dtype),
    }
    mask = torch.ones(rewards_N.numel(), 3)
    for name in GROUP_ALGORITHMS:
        inputs = AdvantageInputs(rewards_N, mask, None, None, None, None, None)
        out[f"{name} (class)"] = (
            ALGORITHMS[name](AlgorithmConfig(name=name, group_size=G)).advantages(inputs).advantages
        )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", EQUAL_VALUES)
@pytest.mark.parametrize("G", range(2, 17))
def test_equal_group_gets_exactly_zero_advantage(G, value, dtype):
    """Acceptance: an all-equal group of 0.1 (or any float) gets advantage exactly 0 for G = 2..16,
    beside informative groups, in every group-baseline algorithm, from float32 and float64 rewards."""
    informative = torch.linspace(-1.0, 2.0, G, dtype=dtype)
    rewards = torch.cat([informative, torch.full((G,), value, dtype=dtype), informative.flip(0)])
    for name, adv in _group_baseline_advantages(rewards, G).items():
        assert adv.dtype == dtype, name
        assert adv[G : 2 * G].tolist() == [0.0] * G, f"{name}: G={G}, reward {value!r}"
        assert adv[:G].abs().max() > 0.1, name


def test_the_float32_mean_was_the_bug():
    """What the test above guards against, in numbers: in float32 the mean of eight rewards of 0.7
    is one rounding step off, the std is (nearly) 0, and (r - mean) / (std + 1e-6) is ~0.056 for every
    sample, of one sign (0.3 from G = 6, 0.1 and 0.7 from G = 7 do the same on this CPU)."""
    r = torch.full((1, 8), 0.7, dtype=torch.float32)
    centred = r - r.mean(dim=1, keepdim=True)
    old = centred / (r.std(dim=1, keepdim=True) + 1e-6)
    assert centred.abs().max().item() > 0 and r.std(dim=1).item() < 1e-6  # the rounding step and its 'spread'
    assert old.abs().min().item() > 0.05 and (old.sign() == old.sign()[0, 0]).all()
    assert group_advantages(r.view(-1), 8, normalize_std=True).tolist() == [0.0] * 8


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 16),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.floats(-1e6, 1e6), min_size=16, max_size=16),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_equal_groups_are_exactly_zero_property(G, value, other, dtype):
    """Property: for any finite reward value (binary fractions or not, tiny or huge) and any group
    size 2..16, a group of equal rewards gets advantage exactly 0 in every group-baseline
    algorithm, whatever the other group in the batch holds."""
    if dtype == torch.float32:
        value = max(min(value, 3e38), -3e38)  # representable in float32
    rewards = torch.cat([torch.tensor(other[:G], dtype=dtype), torch.full((G,), value, dtype=dtype)])
    for name, adv in _group_baseline_advantages(rewards, G).items():
        assert adv[G:].tolist() == [0.0] * G, f"{name}: G={G}, reward {value!r}, {dtype}"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=12, max_size=12), st.permutations(list(range(4))))
def test_advantages_invariant_to_group_order_and_within_group_permutation(rewards, perm):
    r = torch.tensor(rewards).view(3, 4)
    adv = group_advantages(r.flatten(), 4, True).view(3, 4)
    permuted = group_advantages(r[[2, 0, 1]][:, perm].flatten(), 4, True).view(3, 4)
    torch.testing.assert_close(permuted, adv[[2, 0, 1]][:, perm])


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref  # [0.5, -1.0]
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx(d.tolist())
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx((0.5 * d**2).tolist())
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0])
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


def _k3_f64(x, clamp):
    """Schulman's k3 of log r' = x; clamped as verl's low_var_kl: x to [-20, 20], k3 to [-10, 10]."""
    if clamp:
        x = min(max(x, -20.0), 20.0)
        return min(max(math.exp(-x) - 1 + x, -10.0), 10.0)
    return math.exp(-x) - 1 + x


def _reference_loss_f64(
    lp, old, adv, mask, lo, hi, agg, ref=None, beta=0.0, est="k3", norm=0.0, dual_c=0.0, clamp=True
):
    """Independent loop implementation in float64."""
    B, T = len(lp), len(lp[0])
    per_tok, n_tok, seq_terms = [[0.0] * T for _ in range(B)], 0.0, []
    for b in range(B):
        for t in range(T):
            if mask[b][t] == 0:
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            a = adv[b]
            val = max(-a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi))
            if dual_c and a < 0:  # Ye et al. 2020: the loss of a negative advantage is at most -c A
                val = min(val, -dual_c * a)
            if beta:
                x = lp[b][t] - ref[b][t]
                val += beta * {"k1": x, "k2": 0.5 * x * x, "k3": _k3_f64(x, clamp)}[est]
            per_tok[b][t] = val
            n_tok += 1
    if agg == "token-mean":
        return sum(map(sum, per_tok)) / n_tok
    for b in range(B):
        n = sum(mask[b])
        s = sum(per_tok[b])
        seq_terms.append(
            {"seq-mean-token-mean": s / max(n, 1), "seq-mean-token-sum": s, "seq-mean-token-sum-norm": s / norm}[agg]
        )
    return sum(seq_terms) / B


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dual_c", [0.0, 3.0])
def test_grpo_loss_matches_float64_reference(agg, est, dual_c):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios far enough from 1 to clip
    old[1, :2] = lp[1, :2] - 1.5  # ratio e^1.5 = 4.5 > 3 on tokens with A < 0: the dual clip's cap
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref[2, 1], ref[3, 0] = lp[2, 1] + 3.0, lp[3, 0] - 25.0  # k3 beyond its clamp: e^3 - 4 > 10, and |log r'| > 20
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).double()
    lo, hi, beta, norm = 0.2, 0.28, 0.05, 7.0
    out = clipped_pg_loss(
        lp,
        old,
        adv,
        mask,
        clip_low=lo,
        clip_high=hi,
        loss_agg=agg,
        loss_agg_norm=norm,
        num_global_tokens=mask.sum().item(),
        num_global_seqs=B,
        ref_logprobs_BT=ref,
        kl_coef=beta,
        kl_estimator=est,
        dual_clip_c=dual_c,
    )
    expected = _reference_loss_f64(
        lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), lo, hi, agg, ref.tolist(), beta, est, norm, dual_c
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert 0 < out.clipped_tokens.item() < mask.sum().item()
    if dual_c:  # the two capped tokens are counted as clipped, and the cap changed the loss
        no_dual = _reference_loss_f64(
            lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), lo, hi, agg, ref.tolist(), beta, est, norm
        )
        assert expected != pytest.approx(no_dual, rel=1e-6)


def test_dual_clip_caps_negative_advantages_by_hand():
    """A = -1, ratio 5: PPO's clipped loss is max(5, 0.8) = 5; dual-clip c = 3 caps it at 3, with no
    gradient. A = -1, ratio 2 (< c) and A = +1, ratio 5 are untouched."""
    lp = torch.log(torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    kw = dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-sum", num_global_tokens=3, num_global_seqs=1)
    out = clipped_pg_loss(lp, old, adv, torch.ones(1, 3, dtype=torch.float64), dual_clip_c=3.0, **kw)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(3.0 + 2.0 - 1.2)
    assert lp.grad.tolist() == [pytest.approx([0.0, 2.0, 0.0])]  # d(-A r)/d log r = -A r = 2 on the middle token
    assert out.clipped_tokens.item() == 2  # the capped token and the A > 0 token clipped at 1.2
    off = clipped_pg_loss(lp.detach(), old, adv, torch.ones(1, 3, dtype=torch.float64), **kw)
    assert off.loss.item() == pytest.approx(5.0 + 2.0 - 1.2)


def test_k3_clamp_bounds_value_and_gradient():
    """Clamped k3 (the default): estimate at most 10, log ratio clamped at +-20 before the exponential,
    so an extreme token gives a finite value and zero (not NaN) gradient; unclamped k3 is the plain
    formula. k1 and k2 are never clamped."""
    x = torch.tensor([0.5, -3.0, 25.0, -25.0, -800.0], dtype=torch.float64)
    lp = x.clone().requires_grad_()
    ref = torch.zeros_like(x)
    k3 = kl_estimate(lp, ref, "k3")
    assert k3.tolist() == pytest.approx([_k3_f64(v, clamp=True) for v in x.tolist()], rel=1e-14)
    assert k3.tolist()[1:] == [10.0] * 4
    k3.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.tolist()[1:] == [0.0] * 4
    unclamped = kl_estimate(x[:4], ref[:4], "k3", clamp=False)
    assert unclamped.tolist() == pytest.approx([_k3_f64(v, clamp=False) for v in x[:4].tolist()], rel=1e-14)
    assert kl_estimate(x, ref, "k1").tolist() == x.tolist()
    assert kl_estimate(x, ref, "k2").tolist() == pytest.approx((0.5 * x**2).tolist())


def test_seq_mean_token_sum_norm_divides_by_the_constant():
    """L = 1/B sum_b sum_t m_bt l_bt / C: Dr.GRPO with its constant normaliser; equal to
    seq-mean-token-mean when every sequence is C tokens long, to seq-mean-token-sum / C always."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 7.0]])
    ragged = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    got = aggregate(loss, ragged, "seq-mean-token-sum-norm", 6, 2, norm=4)
    assert got.item() == pytest.approx((3.0 / 4 + 22.0 / 4) / 2)
    assert got.item() == pytest.approx(aggregate(loss, ragged, "seq-mean-token-sum", 6, 2).item() / 4)
    full = torch.ones(2, 4)
    assert aggregate(loss, full, "seq-mean-token-sum-norm", 8, 2, norm=4).item() == pytest.approx(
        aggregate(loss, full, "seq-mean-token-mean", 8, 2).item()
    )
    with pytest.raises(ValueError, match="needs a constant normaliser > 0"):
        aggregate(loss, ragged, "seq-mean-token-sum-norm", 6, 2)


def test_clip_higher_is_asymmetric():
    lp = torch.log(torch.tensor([[1.25, 0.75]]))  # ratios 1.25 and 0.75 against old = 0
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    pos = clipped_pg_loss(
        lp,
        old,
        torch.tensor([1.0]),
        mask,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token-mean",
        num_global_tokens=2,
        num_global_seqs=1,
    )
    # A > 0: ratio 1.25 is inside the high clip (1.28) so unclipped; 0.75 -> max(-0.75, -0.8) = -0.75.
    assert pos.loss.item() == pytest.approx((-1.25 - 0.75) / 2)
    assert pos.clipped_tokens.item() == 0
    sym = clipped_pg_loss(
        lp,
        old,
        torch.tensor([1.0]),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        num_global_tokens=2,
        num_global_seqs=1,
    )
    assert sym.loss.item() == pytest.approx((-1.2 - 0.75) / 2) and sym.clipped_tokens.item() == 1


def test_on_policy_gradient_is_reinforce():
    """With old = logprobs.detach(), ratio = 1 and d loss / d logprob = -A / N."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = clipped_pg_loss(
        lp,
        lp.detach(),
        torch.tensor([2.0]),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        num_global_tokens=2,
        num_global_seqs=1,
    )
    out.loss.backward()
    assert lp.grad.tolist() == [[-1.0, -1.0, 0.0]]
    assert out.ratio_max.item() == 1.0


def test_split_accumulation_equals_whole_batch():
    """Micro-batches normalised by the global count accumulate to the whole-batch gradient."""
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(4, 5, generator=g)).requires_grad_()
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    adv = torch.randn(4, generator=g)
    kw = dict(clip_low=0.2, clip_high=0.2, num_global_tokens=mask.sum().item(), num_global_seqs=4, loss_agg_norm=5.0)
    for agg in AGGS:
        whole = clipped_pg_loss(lp, lp.detach(), adv, mask, loss_agg=agg, **kw).loss
        (g_whole,) = torch.autograd.grad(whole, lp)
        parts = sum(
            clipped_pg_loss(
                lp[i : i + 2], lp[i : i + 2].detach(), adv[i : i + 2], mask[i : i + 2], loss_agg=agg, **kw
            ).loss
            for i in (0, 2)
        )
        (g_parts,) = torch.autograd.grad(parts, lp)
        torch.testing.assert_close(g_parts, g_whole)


def test_sequence_batch_layout_and_split():
    batch = build_sequence_batch([[1, 2], [3, 4, 5]], [[6], [7, 8]], pad_id=0, gen_logprobs=[[-0.5], [-0.1, -0.2]])
    assert batch["tokens"].tolist() == [[1, 2, 6, 0, 0], [3, 4, 5, 7, 8]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]
    assert batch["gen_logprobs"].flatten().tolist() == pytest.approx([0, -0.5, 0, 0, 0, 0, -0.1, -0.2])
    first, second = split_batch(batch, 2)
    assert first["tokens"].shape == (1, 3) and first["loss_mask"].shape == (1, 2)
    assert second["tokens"].shape == (1, 5)
    with pytest.raises(ValueError, match="cannot be split into 3"):
        split_batch(batch, 3)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "sum", 1, 1)


def test_micro_batches_cover_every_row_once_by_token_budget():
    from titanrl.data.batch import micro_batches, num_micro_batches

    g = torch.Generator().manual_seed(0)
    prompts = [[1] * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(10)]
    comps = [[2] * int(torch.randint(1, 9, (1,), generator=g)) for _ in range(10)]
    batch = build_sequence_batch(prompts, comps, pad_id=0)
    assert num_micro_batches(batch["length"].tolist(), 0) == 1
    n = num_micro_batches(batch["length"].tolist(), 24)
    assert n > 1
    chunks = micro_batches(batch, n)
    assert len(chunks) == n
    assert sum(c.batch_size[0] for c in chunks) == 10
    assert sum(c["loss_mask"].sum().item() for c in chunks) == batch["loss_mask"].sum().item()
    for c in chunks:
        assert c["tokens"].shape[1] == int(c["length"].max())  # padding trimmed per chunk
    # A generous budget is one micro-batch; more chunks than needed still covers every row.
    assert num_micro_batches(batch["length"].tolist(), 10_000) == 1
    assert sum(c.batch_size[0] for c in micro_batches(batch, 10)) == 10

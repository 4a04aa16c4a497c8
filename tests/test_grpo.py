"""GRPO advantages and loss against hand-computed values and an independent float64 reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.algorithms.common import aggregate, clipped_pg_loss, kl_estimate
from titanrl.algorithms.grpo import group_advantages
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


def _reference_loss_f64(lp, old, adv, mask, lo, hi, agg, ref=None, beta=0.0, est="k3"):
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
            if beta:
                x = lp[b][t] - ref[b][t]
                val += beta * {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) - 1 + x}[est]
            per_tok[b][t] = val
            n_tok += 1
    if agg == "token-mean":
        return sum(map(sum, per_tok)) / n_tok
    for b in range(B):
        n = sum(mask[b])
        s = sum(per_tok[b])
        seq_terms.append(s / max(n, 1) if agg == "seq-mean-token-mean" else s)
    return sum(seq_terms) / B


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_grpo_loss_matches_float64_reference(agg, est):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    lp = -torch.rand(B, T, generator=g) * 2
    old = lp + 0.4 * torch.randn(B, T, generator=g)  # ratios far enough from 1 to clip
    ref = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]).float()
    lo, hi, beta = 0.2, 0.28, 0.05
    out = clipped_pg_loss(
        lp,
        old,
        adv,
        mask,
        clip_low=lo,
        clip_high=hi,
        loss_agg=agg,
        num_global_tokens=mask.sum().item(),
        num_global_seqs=B,
        ref_logprobs_BT=ref,
        kl_coef=beta,
        kl_estimator=est,
    )
    expected = _reference_loss_f64(
        lp.double().tolist(),
        old.double().tolist(),
        adv.tolist(),
        mask.tolist(),
        lo,
        hi,
        agg,
        ref.double().tolist(),
        beta,
        est,
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert 0 < out.clipped_tokens.item() < mask.sum().item()


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
    kw = dict(clip_low=0.2, clip_high=0.2, num_global_tokens=mask.sum().item(), num_global_seqs=4)
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]:
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

"""Off-policy corrections (`importance_weights`): every mode against a float64 reference written
as plain loops over tokens, on random ratios with padding; 'none' / 'tis' / 'mis' unchanged by
the loss mask; the bounds checked at load; and one short RL run through each new mode."""

import math
import random

import pytest
import torch
from helpers.launch import train_metrics
from helpers.tiny import smoke_run_args

from titanrl.algorithms.common import SEQUENCE_CORRECTIONS, importance_weights
from titanrl.config import load_config

MODES = ["none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis"]
CAP = {"none": 2.0, "tis": 1.5, "mis": 1.5, "icepop": 2.0, "seq_tis": 2.0, "seq_mis": 2.0, "geo_mis": 1.15}
LOW, HIGH = 0.6, 1.8


def reference(old: list[list[float]], gen: list[list[float]], mask: list[list[int]], mode: str, cap: float):
    """(weights, dropped) per token, in python floats, from the definitions: r_t = exp(old - gen);
    per-sequence modes aggregate r_t over the loss tokens (mask 1) of each row."""
    weights, dropped = [], []
    for old_b, gen_b, mask_b in zip(old, gen, mask):
        ratios = [math.exp(o - g) for o, g in zip(old_b, gen_b)]
        if mode in SEQUENCE_CORRECTIONS:
            kept = [r for r, m in zip(ratios, mask_b) if m]
            product = 1.0
            for r in kept:
                product *= r
            if mode == "seq_tis":
                w, d = min(product, cap), product > cap
            else:
                log_sum = 0.0
                for r in kept:
                    log_sum += math.log(r)
                seq_ratio = product if mode == "seq_mis" else math.exp(log_sum / max(len(kept), 1))
                d = not (1.0 / cap <= seq_ratio <= cap)
                w = 0.0 if d else seq_ratio
            weights.append([w] * len(ratios))
            dropped.append([d] * len(ratios))
            continue
        row_w, row_d = [], []
        for r in ratios:
            if mode == "none":
                w, d = 1.0, False
            elif mode == "tis":
                w, d = min(r, cap), r > cap
            else:
                low, high = (LOW, HIGH) if mode == "icepop" else (1.0 / cap, cap)
                d = not (low <= r <= high)
                w = 0.0 if d else r
            row_w.append(w)
            row_d.append(d)
        weights.append(row_w)
        dropped.append(row_d)
    return weights, dropped


def random_batch(seed: int, rows: int = 24, length: int = 7):
    """float64 logprobs whose token ratios spread around 1 (log ratio ~ N(0, 0.45)), each row
    with 0 to 3 padding tokens on the right and one row with no loss token at all."""
    rng = random.Random(seed)
    gen = [[-rng.uniform(0.1, 3.0) for _ in range(length)] for _ in range(rows)]
    old = [[g + rng.gauss(0.0, 0.45) for g in row] for row in gen]
    mask = [[1 if t < length - rng.randint(0, 3) else 0 for t in range(length)] for _ in range(rows)]
    mask[0] = [0] * length
    return old, gen, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_match_the_float64_reference(mode, seed):
    old, gen, mask = random_batch(seed)
    tensors = [torch.tensor(x, dtype=torch.float64) for x in (old, gen, mask)]
    w_BT, dropped_BT = importance_weights(*tensors[:2], mode, CAP[mode], tensors[2], low=LOW, high=HIGH)
    ref_w, ref_d = reference(old, gen, mask, mode, CAP[mode])
    on = torch.tensor(mask, dtype=torch.bool)
    torch.testing.assert_close(w_BT[on], torch.tensor(ref_w, dtype=torch.float64)[on], rtol=1e-12, atol=0.0)
    assert torch.equal(dropped_BT[on], torch.tensor(ref_d)[on])
    assert w_BT.dtype == torch.float64 and w_BT.shape == on.shape and dropped_BT.shape == on.shape
    flags = [d for d_row, m_row in zip(ref_d, mask) for d, m in zip(d_row, m_row) if m]
    if mode != "none":  # the inputs exercise both sides of each bound: the test can fail
        assert any(flags) and not all(flags)


def test_a_sequence_without_loss_tokens_keeps_weight_one():
    old = torch.tensor([[0.5, -0.7], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    for mode in SEQUENCE_CORRECTIONS:
        w_BT, dropped_BT = importance_weights(old, torch.zeros_like(old), mode, 2.0, mask)
        assert w_BT.tolist() == [[1.0, 1.0], [1.0, 1.0]] and not dropped_BT.any()


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_token_modes_are_unchanged_by_the_new_arguments(mode):
    """'none' / 'tis' / 'mis' give bit-identical results with or without the mask and bounds, and
    equal the expressions they had before the sequence modes existed."""
    old, gen, mask = (torch.tensor(x, dtype=torch.float32) for x in random_batch(3))
    before = importance_weights(old, gen, mode, 1.5)
    after = importance_weights(old, gen, mode, 1.5, mask, low=0.9, high=1.1)
    ratio = torch.exp(old - gen)
    expected = {
        "none": (torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)),
        "tis": (ratio.clamp(max=1.5), ratio > 1.5),
        "mis": (torch.where((ratio > 1.5) | (ratio < 1 / 1.5), 0.0, ratio), (ratio > 1.5) | (ratio < 1 / 1.5)),
    }[mode]
    for got in (before, after):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_long_sequences_neither_overflow_nor_pass_gradient():
    """float32, 4096 tokens of log ratio +-0.05: the product is e^+-205 (beyond float32), yet the
    weights stay finite, in log space; the weights carry no gradient to the trainer's logprobs."""
    old = torch.full((2, 4096), 0.05)
    old[1] = -0.05
    old.requires_grad_(True)
    mask = torch.ones(2, 4096)
    w, d = importance_weights(old, torch.zeros(2, 4096), "seq_tis", 2.0, mask)
    assert torch.allclose(w[0], torch.tensor(2.0)) and d[0].all() and not d[1].any() and w[1, 0] == 0.0
    assert not w.requires_grad
    for mode in ("seq_mis", "geo_mis"):
        w, d = importance_weights(old, torch.zeros(2, 4096), mode, 1.01, mask)
        assert torch.isfinite(w).all() and not w.requires_grad
    assert (w[0] == 0.0).all() and d.all()  # geo_mis: g = e^+-0.05 is outside [1/1.01, 1.01]


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="choose none, tis, mis, icepop, seq_tis, seq_mis or geo_mis"):
        importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), "seq", 2.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algorithm.off_policy_correction=icepop", "--algorithm.is_low=1.2"], r"0 < is_low < 1 < is_high"),
        (["--algorithm.off_policy_correction=icepop", "--algorithm.is_low=0"], r"0 < is_low < 1 < is_high"),
        (["--algorithm.off_policy_correction=icepop", "--algorithm.is_high=0.9"], r"0 < is_low < 1 < is_high"),
        (["--algorithm.off_policy_correction=mis", "--algorithm.is_high=3"], r"only read by .*'icepop', not 'mis'"),
        (["--algorithm.off_policy_correction=geo_mis", "--algorithm.is_cap=1"], r"is_cap must be > 1"),
    ],
)
def test_bad_bounds_fail_at_load(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


@pytest.mark.parametrize("mode", ["icepop", "seq_tis", "seq_mis", "geo_mis"])
def test_new_modes_are_accepted_where_tis_is(mode):
    config = load_config([f"--algorithm.off_policy_correction={mode}", "--rollout.partial=true"])
    assert config.algorithm.off_policy_correction == mode
    config = load_config([f"--algorithm.off_policy_correction={mode}", "--rollout.mode=one_step"])
    assert config.rollout.mode == "one_step"


# Bounds around 1 tighter than the generator/trainer rounding gap (gen_logprob_diff ~2e-7): the mode drops tokens.
TIGHT = {
    "icepop": ["--algorithm.is_low=0.9999999", "--algorithm.is_high=1.0000001"],
    "geo_mis": ["--algorithm.is_cap=1.0000001"],
}


@pytest.mark.parametrize("mode", ["icepop", "geo_mis"])
def test_rl_steps_run_with_the_new_modes(tmp_path, mode):
    """Two RL steps of the debug job with two mini-batches per step (the second is off-policy)
    and bounds tighter than the sampler/trainer rounding gap: the steps train and log the
    fraction of dropped tokens, which the mode makes > 0."""
    args = smoke_run_args(
        f"--job.dump_folder={tmp_path}",
        f"--algorithm.off_policy_correction={mode}",
        "--algorithm.num_minibatches=2",
        *TIGHT[mode],
        steps=2,
        sft_steps=0,
    )
    steps = [r for r in train_metrics(args, tmp_path) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert 0.0 < row["is_dropped_frac"] <= 1.0, row
        assert math.isfinite(row["grad_norm"]) and row["skipped_updates"] == 0

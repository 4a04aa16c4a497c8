"""Pieces shared by policy-gradient algorithms: KL estimators, the clipped surrogate loss,
aggregation, masked whitening, token-level rewards, group baselines, off-policy importance weights.

Aggregation divides by *global* counts (summed over data-parallel ranks and micro-batches)
that the caller passes in, so the gradient is the same however a batch is split.

Group-baseline advantages are computed in float64 and returned in `advantage_dtype` of the rewards (float32 for
the float32 rewards of a run, float64 for float64 inputs): in float32 the mean of G equal rewards
that are not exact binary fractions (0.1, 0.3, 0.7) can come out one rounding step off, and
GRPO's division by the (near-zero) std + 1e-6 turned that step into an advantage of ~0.06 for
the whole group; a group whose max equals its min now gets exactly 0 (`equal_groups`).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from titanrl.config.algorithm import ICEPOP_HIGH, ICEPOP_LOW

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

K3_LOG_RATIO_BOUND = 20.0
"""With `clamp`, k3's log ratio is clamped to [-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND] before the exponential."""

K3_BOUND = 10.0
"""With `clamp`, the k3 estimate is clamped to [-K3_BOUND, K3_BOUND] (k3 >= 0, so to [0, K3_BOUND])."""


def kl_estimate(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str, clamp: bool = True
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): k1 = log r', k2 = (log r')^2 / 2, k3 = r - 1 - log r, with
    log r' = logp - logp_ref and r = pi_ref / pi. k3 is unbiased and non-negative.

    `clamp` (k3 only; verl's `low_var_kl`, verl/trainer/ppo/core_algos.py `kl_penalty`):
    log r' is clamped to [-20, 20] before the exponential and k3 to [-10, 10],

        k3_clamped = clamp(exp(-x) - 1 + x, -10, 10),   x = clamp(logp - logp_ref, -20, 20),

    so one token the policy has moved far from the reference (r up to e^20) cannot dominate the
    loss or the reward; outside the bounds the term is constant and passes no gradient. Where
    k3 < 10 (-2.61 < log r' < 11.0) it is the plain k3."""
    log_ratio = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        if clamp:
            log_ratio = log_ratio.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
            return (torch.exp(-log_ratio) - 1.0 + log_ratio).clamp(-K3_BOUND, K3_BOUND)
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}'; choose k1, k2 or k3")


def advantage_dtype(rewards: torch.Tensor) -> torch.dtype:
    """The dtype advantages are returned in: the rewards' own floating dtype, at least float32
    (float32 rewards of a run give float32 advantages, float64 inputs float64)."""
    return torch.promote_types(rewards.dtype, torch.float32)


def group_rewards(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rewards laid out as consecutive groups of `group_size`, as float64 [P, G]."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not form groups of {group_size}")
    return rewards_N.double().view(-1, group_size)


def equal_groups(r_PG: torch.Tensor) -> torch.Tensor:
    """[P, 1] bool: True where a group's rewards are all equal (max == min), whose advantages are
    set to exactly 0 whatever rounding left in r - mean."""
    return r_PG.max(dim=1, keepdim=True).values == r_PG.min(dim=1, keepdim=True).values


def group_centred(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """r_i - mean(r of i's group) in float64 [N], exactly 0 in groups of equal rewards (the
    baseline of REINFORCE++-baseline; GRPO's numerator)."""
    r_PG = group_rewards(rewards_N, group_size)
    centred = r_PG - r_PG.mean(dim=1, keepdim=True)
    return torch.where(equal_groups(r_PG), 0.0, centred).view(-1)


def per_token(advantages: torch.Tensor, like_BT: torch.Tensor) -> torch.Tensor:
    """Advantages per sequence [B] broadcast over the tokens of `like_BT`; per token [B, T] as they are."""
    return advantages[:, None].expand_as(like_BT) if advantages.dim() == 1 else advantages


def clipped_surrogate(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective as a loss: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)).

    Dual clip (`dual_clip_c` = c > 1; 0 is off): Ye et al., "Mastering complex control in MOBA
    games with deep reinforcement learning" (AAAI 2020), arXiv:1912.09729; verl's
    `clip_ratio_c` (default 3.0 there). For A < 0 the clipped loss grows without bound in r
    (-A r with r -> inf); the dual clip caps it at -c A:

        L = min(max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), -c A)    if A < 0
        L = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))               if A >= 0

    so a token whose ratio exceeds c (r > c) contributes a constant and no gradient.

    Returns (loss_BT, clipped_BT) where clipped marks tokens whose clipped term (or the dual
    clip's cap) was chosen.
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped = -advantages_BT * ratio_BT
    clipped = -advantages_BT * torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    loss_BT, clipped_BT = torch.maximum(unclipped, clipped), clipped > unclipped
    if dual_clip_c > 0:
        cap_BT = -advantages_BT * dual_clip_c
        capped_BT = (advantages_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(capped_BT, cap_BT, loss_BT)
        clipped_BT = clipped_BT | capped_BT
    return loss_BT, clipped_BT


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    agg: LossAgg,
    num_global_tokens: float,
    num_global_seqs: float,
    norm: float = 0.0,
) -> torch.Tensor:
    """Reduce per-token losses to the local share of the global loss.

    token-mean: sum over all tokens / global token count (DAPO's token-level loss).
    seq-mean-token-mean: mean over each sequence's tokens, then / global sequence count (GRPO).
    seq-mean-token-sum: sum over each sequence's tokens, then / global sequence count (Dr.GRPO,
    whose constant length normaliser is absorbed in the learning rate).
    seq-mean-token-sum-norm: sum over each sequence's tokens / `norm`, then / global sequence
    count: L = 1/B * sum_b sum_t m_bt l_bt / C with a constant C (`norm`, algorithm.loss_agg_norm:
    the maximum response length by default). Dr.GRPO (Liu et al., arXiv:2503.20783, sec. 3.2)
    with its constant normaliser written out, as verl's `seq-mean-token-sum-norm` (which divides
    by the padded response length, or its `loss_scale_factor`); equal to seq-mean-token-mean
    when every sequence is C tokens long.
    """
    masked = loss_BT * mask_BT
    if agg == "token-mean":
        return masked.sum() / num_global_tokens
    per_seq = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / mask_BT.sum(-1).clamp(min=1.0)
    elif agg == "seq-mean-token-sum-norm":
        if not norm > 0:
            raise ValueError(
                f"loss aggregation 'seq-mean-token-sum-norm' needs a constant normaliser > 0, got {norm}: set "
                "algorithm.loss_agg_norm (0 is resolved to the maximum response length by validate_algorithm)"
            )
        per_seq = per_seq / norm
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation '{agg}'")
    return per_seq.sum() / num_global_seqs


def masked_whiten(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, dp_group: dist.ProcessGroup | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the *global* batch (summed over
    `dp_group`), zero outside the mask; the sums are taken in the values' dtype, then reduced and
    combined in float64.

    std is the *population* std, sqrt(sum (x - mean)^2 / n), as OpenRLHF normalises advantages
    globally. verl's `masked_whiten` (verl/utils/torch_functional.py) uses the unbiased variance,
    sum (x - mean)^2 / (n - 1), and adds eps to the variance under rsqrt: the two differ by a
    factor sqrt(n / (n - 1)), below 1e-3 relative for the thousands of tokens of a batch. titanrl
    keeps the population estimator on purpose: it is the one defined for n = 1 and it is what the
    dp-summed moments give without a second all-reduce."""
    stats = torch.stack([(values_BT * mask_BT).sum(), (values_BT**2 * mask_BT).sum(), mask_BT.sum()]).double()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(stats, group=dp_group)
    total, total_sq, count = stats.tolist()
    count = max(count, 1.0)
    mean = total / count
    var = max(total_sq / count - mean**2, 0.0)
    return (values_BT - mean) / (var**0.5 + eps) * mask_BT


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over masked tokens (masked positions pass G through unchanged);
    with gamma = 1 the reward-to-go sum_{s >= t} r_s."""
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        m = mask_BT[:, t]
        running_B = torch.where(m > 0, rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B * m
    return returns_BT


def token_rewards(
    scores_B: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_scores: list[list[float]] | None = None,
) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL_t on every completion token, plus the sequence's score on
    its last completion token (the token-level KL-in-reward of PPO / REINFORCE++ / ReMax's
    reward-to-go), in `advantage_dtype(scores_B)`.

    Multi-turn: with `turn_scores` (a list of per-turn rewards per row, non-empty), reward k of a
    row goes on the last token of its k-th model turn (the k-th run of 1s in the mask; surplus
    rewards go on the last turn) instead of `scores_B`.
    """
    rewards_BT = torch.zeros_like(mask_BT, dtype=advantage_dtype(scores_B))
    if kl_BT is not None and kl_coef > 0:
        rewards_BT = rewards_BT - kl_coef * kl_BT * mask_BT
    if turn_scores is not None:
        on = (mask_BT > 0).tolist()
        for b, scores in enumerate(turn_scores):
            ends = [t for t in range(len(on[b])) if on[b][t] and (t + 1 == len(on[b]) or not on[b][t + 1])]
            for k, score in enumerate(scores if ends else []):
                rewards_BT[b, ends[min(k, len(ends) - 1)]] += score
        return rewards_BT
    positions = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT > 0, positions, -1).max(dim=1).values
    has_tokens = last_B >= 0
    rows = torch.arange(mask_BT.shape[0], device=mask_BT.device)[has_tokens]
    rewards_BT[rows, last_B[has_tokens]] += scores_B.to(rewards_BT.dtype)[has_tokens]
    return rewards_BT


OffPolicyCorrection = Literal["none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis"]

SEQUENCE_CORRECTIONS = ("seq_tis", "seq_mis", "geo_mis")
"""The corrections whose weight is one number per sequence, aggregated over its loss tokens."""


def importance_weights(
    old_logprobs_BT: torch.Tensor,
    gen_logprobs_BT: torch.Tensor,
    mode: OffPolicyCorrection,
    cap: float,
    mask_BT: torch.Tensor | None = None,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights that correct for the generator sampling from pi_gen (an older policy, or another
    engine) while the loss assumes the trainer's pi_old, from r_t = pi_old(y_t) / pi_gen(y_t),
    with no gradient. Per token:

      tis    (truncated IS; Yao et al., "Your efficient RL framework secretly brings you
             off-policy RL training", 2025): w_t = min(r_t, C)
      mis    (masked IS; Liu et al., "When speed kills stability", 2025): w_t = r_t if
             1/C <= r_t <= C, else 0, i.e. the token is dropped from the loss.
      icepop (Ling Team, "Small leak can sink a great ship", 2025): w_t = r_t if
             low <= r_t <= high (their alpha = 0.5, beta = 5), else 0.

    Per sequence b, over its loss tokens T_b (`mask_BT` > 0), one weight on every token of b
    (verl's rollout IS `rollout_is_level = "sequence" | "geometric"`; Liu et al.):

      seq_tis: w_b = min(rho_b, C),                      rho_b = prod_{t in T_b} r_t
      seq_mis: w_b = rho_b if 1/C <= rho_b <= C, else 0  (the whole sequence is dropped)
      geo_mis: w_b = g_b if 1/C <= g_b <= C, else 0,     g_b = exp(mean_{t in T_b} log r_t)

    The sequence ratios are computed in log space (sum of log r_t), so a long sequence's
    product does not overflow; a sequence without loss tokens has w_b = 1.

    Returns (weights_BT, dropped_BT) where dropped marks tokens truncated (tis, seq_tis) or
    masked (mis, icepop, seq_mis, geo_mis); per-sequence modes mark every token of the sequence.
    """
    ratio_BT = torch.exp(old_logprobs_BT.detach() - gen_logprobs_BT)
    if mode == "none":
        return torch.ones_like(ratio_BT), torch.zeros_like(ratio_BT, dtype=torch.bool)
    if mode == "tis":
        dropped = ratio_BT > cap
        return ratio_BT.clamp(max=cap), dropped
    if mode == "mis":
        dropped = (ratio_BT > cap) | (ratio_BT < 1.0 / cap)
        return torch.where(dropped, 0.0, ratio_BT), dropped
    if mode == "icepop":
        dropped = (ratio_BT > high) | (ratio_BT < low)
        return torch.where(dropped, 0.0, ratio_BT), dropped
    if mode in SEQUENCE_CORRECTIONS:
        assert mask_BT is not None, f"off-policy correction '{mode}' needs the loss mask"
        return sequence_weights(old_logprobs_BT.detach() - gen_logprobs_BT, mask_BT, mode, cap)
    raise ValueError(
        f"unknown off-policy correction '{mode}'; choose none, tis, mis, icepop, seq_tis, seq_mis or geo_mis"
    )


def sequence_weights(
    log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`importance_weights` of the per-sequence modes (seq_tis, seq_mis, geo_mis) from the token
    log ratios: the sum of log r_t over each sequence's loss tokens (its mean for geo_mis),
    bounded in log space against log C, broadcast back over the sequence's tokens."""
    on_BT = mask_BT > 0
    log_w_B = torch.where(on_BT, log_ratio_BT, 0.0).sum(-1)
    if mode == "geo_mis":
        log_w_B = log_w_B / on_BT.sum(-1).clamp(min=1)
    log_cap = math.log(cap)
    if mode == "seq_tis":
        dropped_B = log_w_B > log_cap
        w_B = torch.exp(log_w_B.clamp(max=log_cap))
    else:
        dropped_B = log_w_B.abs() > log_cap
        w_B = torch.where(dropped_B, 0.0, torch.exp(log_w_B))
    return w_B[:, None].expand_as(log_ratio_BT), dropped_B[:, None].expand_as(log_ratio_BT)


@dataclass
class LossInputs:
    """What a policy loss may use, for one micro-batch (the twin of `base.AdvantageInputs`);
    [B, T] tensors are per next-token target."""

    logprobs_BT: torch.Tensor
    """log pi(y_t) under the policy being trained (with gradient)."""

    old_logprobs_BT: torch.Tensor
    """log pi_old(y_t), the trainer's policy before this step's updates (on-policy with a single
    update: this very forward, detached, so the ratio is exactly 1)."""

    advantages: torch.Tensor
    """Per sequence [B] or per token [B, T]."""

    mask_BT: torch.Tensor
    """1 on the tokens trained on."""

    num_global_tokens: float
    """Loss tokens of the optimizer step, summed over data-parallel ranks and micro-batches."""

    num_global_seqs: float
    """Sequences of the optimizer step, summed likewise."""

    ref_logprobs_BT: torch.Tensor | None = None
    """log pi_ref(y_t) of the frozen reference, for the KL term; None without one."""

    is_weights_BT: torch.Tensor | None = None
    """Off-policy importance weights pi_old / pi_gen (`importance_weights`); None: no correction."""

    @property
    def advantages_BT(self) -> torch.Tensor:
        """The advantages per token: per-sequence ones broadcast over their tokens."""
        return per_token(self.advantages, self.logprobs_BT)


@dataclass(frozen=True)
class LossSpec:
    """How a policy term becomes the loss, the same for every algorithm: the aggregation and the
    KL to the reference (`kl_coef` 0 when the KL is in the reward)."""

    loss_agg: LossAgg
    """`aggregate`'s mode."""

    loss_agg_norm: float = 0.0
    """The constant of 'seq-mean-token-sum-norm'."""

    kl_coef: float = 0.0
    """beta of the KL term beta * KL_t; 0 adds none."""

    kl_estimator: str = "k3"
    """k1, k2 or k3 (`kl_estimate`)."""

    kl_clamp: bool = True
    """Clamp k3 (`kl_estimate`)."""


@dataclass
class PolicyTerm:
    """An algorithm's per-token policy loss, before importance weights, KL and aggregation."""

    loss_BT: torch.Tensor
    """The per-token policy loss (with gradient)."""

    clipped_BT: torch.Tensor
    """Bool: tokens the algorithm's clip (or gate) acted on; their fraction is `clip_frac`."""

    ratio_BT: torch.Tensor | None = None
    """The importance ratio whose maximum is logged (`ratio_max`); None: pi(y_t) / pi_old(y_t)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Local share of the global loss (sum over ranks/micro-batches is the full loss)."""
    policy_loss_sum: torch.Tensor
    kl_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_max: torch.Tensor
    """The largest ratio over the masked tokens (1 when there are none), a tensor on the device."""


def policy_loss(term: PolicyTerm, inputs: LossInputs, spec: LossSpec) -> LossOutput:
    """The one assembly of every policy loss: the policy term weighted by the off-policy
    importance weights (when given), plus beta * KL_t when `spec.kl_coef` > 0, aggregated with
    `spec.loss_agg` over the global counts; and the statistics every policy loss reports, on
    the device (no host sync)."""
    pg_BT, mask_BT = term.loss_BT, inputs.mask_BT
    if inputs.is_weights_BT is not None:
        pg_BT = pg_BT * inputs.is_weights_BT
    loss_BT = pg_BT
    kl_BT = torch.zeros_like(pg_BT)
    if spec.kl_coef > 0:
        assert inputs.ref_logprobs_BT is not None, "kl_coef > 0 needs reference logprobs"
        kl_BT = kl_estimate(inputs.logprobs_BT, inputs.ref_logprobs_BT, spec.kl_estimator, spec.kl_clamp)
        loss_BT = loss_BT + spec.kl_coef * kl_BT
    loss = aggregate(
        loss_BT, mask_BT, spec.loss_agg, inputs.num_global_tokens, inputs.num_global_seqs, spec.loss_agg_norm
    )
    with torch.no_grad():
        ratio_BT = term.ratio_BT
        if ratio_BT is None:
            ratio_BT = torch.exp(inputs.logprobs_BT - inputs.old_logprobs_BT)
        return LossOutput(
            loss=loss,
            policy_loss_sum=(pg_BT * mask_BT).sum(),
            kl_sum=(kl_BT * mask_BT).sum(),
            clipped_tokens=(term.clipped_BT.float() * mask_BT).sum(),
            ratio_max=torch.where(mask_BT.any(), (ratio_BT * mask_BT).max(), 1.0),
        )


def loss_arguments(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor, **kw
) -> tuple[LossInputs, LossSpec]:
    """The keyword form of the loss functions (`clipped_pg_loss`, `cispo.cispo_loss`, ...): `kw`
    names fields of `LossInputs` (num_global_tokens, num_global_seqs, ref_logprobs_BT,
    is_weights_BT) and of `LossSpec` (loss_agg, loss_agg_norm, kl_coef, kl_estimator, kl_clamp)."""
    input_names = {f.name for f in dataclasses.fields(LossInputs)}
    inputs = LossInputs(
        logprobs_BT, old_logprobs_BT, advantages, mask_BT, **{k: v for k, v in kw.items() if k in input_names}
    )
    return inputs, LossSpec(**{k: v for k, v in kw.items() if k not in input_names})


def clipped_term(inputs: LossInputs, clip_low: float, clip_high: float, dual_clip_c: float = 0.0) -> PolicyTerm:
    """PPO's clipped surrogate as a policy term (`clipped_surrogate`)."""
    loss_BT, clipped_BT = clipped_surrogate(
        inputs.logprobs_BT, inputs.old_logprobs_BT, inputs.advantages_BT, clip_low, clip_high, dual_clip_c
    )
    return PolicyTerm(loss_BT, clipped_BT)


def clipped_pg_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float = 0.0,
    **kw,
) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), shared by GRPO, Dr.GRPO,
    DAPO, RLOO, ReMax, REINFORCE++ and PPO, which differ only in their advantages:

        L_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) + beta * KL_t,
        r_t = pi(y_t) / pi_old(y_t),

    and, with `dual_clip_c` = c > 1, the policy term of a token with A_t < 0 capped at -c A_t
    (`clipped_surrogate`). `advantages` is per sequence [B] or per token [B, T]; w_t are off-policy
    importance weights (`importance_weights`, 1 when None); KL_t one of k1/k2/k3 to the reference
    policy (k3 clamped with `kl_clamp`, `kl_estimate`); `kw` are the fields of `LossInputs` and
    `LossSpec` (`loss_arguments`), assembled by `policy_loss`.
    """
    inputs, spec = loss_arguments(logprobs_BT, old_logprobs_BT, advantages, mask_BT, **kw)
    return policy_loss(clipped_term(inputs, clip_low, clip_high, dual_clip_c), inputs, spec)

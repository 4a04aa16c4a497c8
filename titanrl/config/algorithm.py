"""The RL loss: `[algorithm]` (the algorithm and its shared settings; an algorithm's own
settings are its `Settings`, beside it in `titanrl/algorithms/`), `[critic]` (the value model of
PPO) and `[distillation]` (a teacher's term in the same loss). A docstring under every field; each
section checks its own fields in `validate()`."""

from dataclasses import dataclass, field
from typing import Any, Literal

ICEPOP_LOW, ICEPOP_HIGH = 0.5, 5.0
"""IcePop's acceptance region [alpha, beta] of the token ratio pi_train / pi_infer (Ling Team,
"Small leak can sink a great ship", 2025): the defaults of algorithm.is_low / is_high."""


@dataclass
class Algorithm:
    name: str = "grpo"
    """Advantage estimator and policy loss, from the registry in `titanrl/algorithms/` (one file
    each): 'grpo' (group mean/std; also Dr.GRPO and DAPO, see their recipes), 'rloo'
    (leave-one-out), 'remax' (greedy-completion baseline), 'reinforce_pp' (whitened token returns),
    'gspo' (sequence ratio), 'cispo' (clipped IS weight), 'sapo' (soft gate instead of a clip), 'ppo'
    (GAE with a learned critic: needs [critic] enable = true); or your own as 'package.module:Class'."""

    group_size: int = 8
    """Samples generated per prompt; advantages are normalised within each group."""

    clip_eps_low: float = 0.2
    """Lower PPO clip range: ratios below 1 - clip_eps_low are clipped ('cispo': IS-weight floor, none if >= 1)."""

    clip_eps_high: float = 0.2
    """Upper PPO clip range (clip-higher when larger than clip_eps_low; 'cispo': the weight's cap)."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 skips the reference model."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3) used for the penalty."""

    kl_clamp: bool = True
    """Clamp the k3 estimate as verl's 'low_var_kl' does: log ratio to [-20, 20] before the
    exponential, the estimate to [-10, 10] (constant, no gradient, beyond); false is plain k3.
    k1 and k2 are never clamped."""

    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses become one number: over all tokens, per sequence then mean, per
    sequence summed (Dr.GRPO), or per sequence summed and divided by the constant loss_agg_norm
    (Dr.GRPO with its normaliser, verl's 'seq-mean-token-sum-norm')."""

    loss_agg_norm: int = 0
    """The constant C of loss_agg = 'seq-mean-token-sum-norm': each sequence's summed token losses
    are divided by C (then averaged over sequences). 0 takes the maximum response length:
    generator.max_new_tokens, or env.max_total_tokens with an environment. Only that mode reads it."""

    dual_clip_c: float = 0.0
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): the clipped loss of a token with a
    negative advantage A is capped at -dual_clip_c * A, so ratios above dual_clip_c stop pushing.
    0 is off; otherwise > 1 (verl's clip_ratio_c, 3.0 by default there). For the algorithms with
    the clipped surrogate (not gspo, cispo, sapo)."""

    kl_in_reward: bool = False
    """Put the KL penalty in the reward instead of the loss: per token for 'ppo', 'reinforce_pp'
    and 'remax' with kl_reward = 'reward_to_go', as kl_coef * (sequence KL) subtracted from the
    reward otherwise."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""

    num_minibatches: int = 1
    """Optimizer steps per pass; more than one (or several epochs) makes later updates off-policy."""

    off_policy_correction: Literal["none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "geo_mis"] = "none"
    """Importance weights r = pi_trainer / pi_generator on the loss, for tokens sampled by another
    engine or by older weights (`algorithms/common.py: importance_weights`; docs/algorithms.md).
    Per token: 'tis' truncates r at is_cap; 'mis' drops tokens whose r is outside
    [1/is_cap, is_cap]; 'icepop' drops tokens whose r is outside [is_low, is_high]. Per sequence
    (one weight on all its loss tokens): 'seq_tis' truncates the product of its r at is_cap;
    'seq_mis' drops the sequence whose product is outside [1/is_cap, is_cap]; 'geo_mis' drops the
    sequence whose geometric mean of r is outside [1/is_cap, is_cap] (set is_cap close to 1)."""

    is_cap: float = 2.0
    """Cap C of the off-policy importance ratio (tis, mis, seq_tis, seq_mis, geo_mis); > 1."""

    is_low: float = ICEPOP_LOW
    """Lower bound alpha of the token ratio kept by off_policy_correction = 'icepop' (IcePop's
    0.5); in (0, 1). Only that mode reads it."""

    is_high: float = ICEPOP_HIGH
    """Upper bound beta of the token ratio kept by off_policy_correction = 'icepop' (IcePop's 5);
    > 1. Only that mode reads it."""

    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each algorithm's own settings, written as a table named after it: `[algorithm.sapo]`
    `tau_pos = 1.0` in TOML, `--algorithm.sapo.tau_pos=1.0` on the command line. The algorithm
    class declares and validates them (its `Settings` dataclass); docs/configuration.md lists them."""

    def validate(self) -> None:
        for name in ("ppo_epochs", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"[algorithm] {name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 1:
            raise ValueError(f"[algorithm] group_size must be >= 1, got {self.group_size}")
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"[algorithm] {name} must be >= 0, got {getattr(self, name)}")
        if not self.is_cap > 1.0:
            raise ValueError(f"[algorithm] is_cap must be > 1, got {self.is_cap}")
        self._validate_icepop_bounds()
        if not (self.dual_clip_c == 0 or self.dual_clip_c > 1.0):
            raise ValueError(
                f"[algorithm] dual_clip_c must be 0 (off) or > 1 (verl's default is 3.0), got {self.dual_clip_c}"
            )
        if self.loss_agg_norm < 0:
            raise ValueError(
                f"[algorithm] loss_agg_norm must be >= 0 (0 = the maximum response length), got {self.loss_agg_norm}"
            )
        if self.loss_agg_norm and self.loss_agg != "seq-mean-token-sum-norm":
            raise ValueError(
                f"[algorithm] loss_agg_norm is only read by loss_agg = 'seq-mean-token-sum-norm', not "
                f"'{self.loss_agg}': remove loss_agg_norm or change loss_agg"
            )

    def _validate_icepop_bounds(self) -> None:
        if not (0.0 < self.is_low < 1.0 < self.is_high):
            raise ValueError(
                f"[algorithm] is_low and is_high must satisfy 0 < is_low < 1 < is_high (IcePop's 0.5 and 5), "
                f"got is_low = {self.is_low}, is_high = {self.is_high}"
            )
        if self.off_policy_correction != "icepop" and (self.is_low, self.is_high) != (ICEPOP_LOW, ICEPOP_HIGH):
            raise ValueError(
                f"[algorithm] is_low / is_high are only read by off_policy_correction = 'icepop', not "
                f"'{self.off_policy_correction}': remove them, or use is_cap for that mode"
            )


@dataclass
class Critic:
    enable: bool = False
    """Train a value model beside the policy (required by algorithm 'ppo', unused otherwise)."""

    hf_checkpoint: str = ""
    """Initialise the critic from this HF folder (a causal LM, or a *ForSequenceClassification
    with one label); empty starts from the policy's weights as RL begins, with a new value head."""

    lr: float = 1e-4
    """AdamW learning rate of the critic (its own optimizer; betas and weight decay from [optimizer])."""

    warmup_steps: int = 0
    """First RL steps that train only the critic (the policy is not updated)."""

    value_clip: float = 0.2
    """Clip range of the value loss around the old values; 0 disables it."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"[critic] lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.value_clip < 0:
            raise ValueError("[critic] warmup_steps and value_clip must be >= 0")


@dataclass
class Distillation:
    teacher_hf_checkpoint: str = ""
    """Hugging Face folder of the teacher (same tokenizer and vocabulary as the student); empty
    turns on-policy distillation off."""

    coef: float = 1.0
    """Weight of the distillation advantage -(log pi_student - log pi_teacher) per token
    ('reverse_kl'), or of the JSD loss term ('jsd'): A_t = task_reward_coef * A_task + coef * A_distill."""

    task_reward_coef: float = 0.0
    """Weight of the algorithm's task-reward advantages mixed in (0: pure distillation)."""

    divergence: Literal["reverse_kl", "jsd"] = "reverse_kl"
    """'reverse_kl': per-token advantage -(log pi_s - log pi_t) on the student's samples (Agarwal
    et al. GKD, Thinking Machines' on-policy distillation); 'jsd': GKD's generalised
    Jensen-Shannon divergence with weight jsd_beta, over the full vocabulary at every completion
    position, as a loss term (coef x its token mean; the advantages keep only the task term), in
    chunks of training.logprob_chunk_tokens; one rank without FSDP for now
    (`titanrl/rl/distillation.py`)."""

    jsd_beta: float = 0.5
    """Interpolation weight of the generalised JSD (0 -> forward KL, 1 -> reverse KL)."""

    def validate(self) -> None:
        if self.coef < 0 or self.task_reward_coef < 0:
            raise ValueError("[distillation] coef and task_reward_coef must be >= 0")
        if self.teacher_hf_checkpoint and self.coef == 0 and self.task_reward_coef == 0:
            raise ValueError(
                "[distillation] coef and task_reward_coef are both 0: nothing would be learned; set coef > 0"
            )
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"[distillation] jsd_beta must be in (0, 1), got {self.jsd_beta}")

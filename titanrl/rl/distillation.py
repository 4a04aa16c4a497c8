"""On-policy distillation: a frozen teacher scores the student's own samples, token by token.

Reverse KL (Agarwal et al., "On-policy distillation of language models: learning from
self-generated mistakes" (GKD), arXiv:2306.13649; Thinking Machines, "On-policy distillation",
2025). For a completion y sampled from the student pi_s, each completion token gets

    A^distill_t = -(log pi_s(y_t | y_<t) - log pi_T(y_t | y_<t)),

a one-sample estimate of -KL(pi_s || pi_T) at position t. Used as a per-token advantage (no
discount, no normalisation) its expected policy gradient is -grad KL(pi_s || pi_T)(. | y_<t) at
every position the student visits. It is mixed with the algorithm's advantages A^task (per
sequence [B], broadcast over the tokens, or per token [B, T]):

    A_t = task_reward_coef * A^task_t + coef * A^distill_t        (0 off the loss mask)

Generalised JSD (GKD, `divergence = "jsd"`) is a loss term, not an advantage: over the full
vocabulary at every completion position, with m = beta p_T + (1 - beta) p_s,

    JSD_beta(p_T || p_s) = beta KL(p_T || m) + (1 - beta) KL(p_s || m)

(JSD / beta -> KL(p_T || p_s), forward, as beta -> 0; JSD / (1 - beta) -> KL(p_s || p_T), reverse,
as beta -> 1), added to the policy loss as coef * sum_t JSD_t / (global completion tokens), its
gradient through the student's distribution only (GKD's on-policy objective). Why a loss: the
full-vocabulary divergence at position t depends on the prefix, not on the sampled y_t, so as an
advantage on log pi_s(y_t) it would credit the wrong token; its exact gradient is available, and
needs no sampling. The advantages then carry only the task term. Logits never exist as
[tokens, vocab]: `chunked_jsd` holds one chunk of student and teacher logits at a time and
recomputes them in backward (as `models/logprobs.py`), about 8 x chunk x vocab floats at its peak.

The teacher is built from `distillation.teacher_hf_checkpoint` with the shape in its own
config.json (a larger teacher is the point), frozen, on the trainer's mesh; it is in no checkpoint:
a resumed run loads it from its folder again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule

from titanrl.algorithms.base import Algorithm
from titanrl.algorithms.common import per_token
from titanrl.components.model_builder import build_model
from titanrl.data.batch_forward import forward_logprobs, packed_backend
from titanrl.data.packing import layout_of
from titanrl.models.hf import read_hf_config
from titanrl.models.logprobs import linear_backward
from titanrl.models.model import Transformer

if TYPE_CHECKING:
    from titanrl.config import JobConfig
    from titanrl.rl.host import TrainerHost


def distillation_advantages(
    student_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """A^distill_t = -(log pi_s(y_t) - log pi_T(y_t)) on the loss mask, 0 elsewhere [B, T]."""
    return -(student_logprobs_BT - teacher_logprobs_BT) * mask_BT


def mix_advantages(
    task_advantages: torch.Tensor, distill_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float, task_reward_coef: float
) -> torch.Tensor:
    """A_t = task_reward_coef * A^task_t + coef * A^distill_t [B, T]; A^task per sequence [B] is
    broadcast over the sequence's tokens."""
    task_BT = per_token(task_advantages, mask_BT)
    return (task_reward_coef * task_BT + coef * distill_BT) * mask_BT


# ---- generalised JSD over the full vocabulary, chunked ----


def _log_probs(h_CD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """log_softmax of the chunk's logits in float32 at least (float64 kept, for references)."""
    logits_CV = F.linear(h_CD, weight_VD)
    return torch.log_softmax(logits_CV if logits_CV.dtype == torch.float64 else logits_CV.float(), dim=-1)


def _log_mixture(logp_s_CV: torch.Tensor, logp_t_CV: torch.Tensor, beta: float) -> torch.Tensor:
    """log m = log(beta p_T + (1 - beta) p_s), without leaving log space."""
    return torch.logaddexp(logp_t_CV + math.log(beta), logp_s_CV + math.log1p(-beta))


def jsd_rows(logp_s_CV: torch.Tensor, logp_t_CV: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta(p_T || p_s) per row [C] from log-probabilities [C, V]."""
    logm_CV = _log_mixture(logp_s_CV, logp_t_CV, beta)
    teacher_C = (logp_t_CV.exp() * (logp_t_CV - logm_CV)).sum(-1)
    student_C = (logp_s_CV.exp() * (logp_s_CV - logm_CV)).sum(-1)
    return beta * teacher_C + (1.0 - beta) * student_C


class _ChunkedJSD(torch.autograd.Function):
    """JSD_beta per row [N] from the student's hidden states [N, D] and output weight [V, D] and
    the teacher's [N, E] and [V, E], `chunk` rows of logits at a time; gradients flow to the
    student's hidden states and weight only (the teacher is a target)."""

    @staticmethod
    def forward(ctx, h_s_ND, weight_s_VD, h_t_NE, weight_t_VE, beta: float, chunk: int):
        with torch.no_grad():
            jsd = [
                jsd_rows(_log_probs(hs, weight_s_VD), _log_probs(ht, weight_t_VE), beta)
                for hs, ht in zip(h_s_ND.split(chunk), h_t_NE.split(chunk))
            ]
        ctx.save_for_backward(h_s_ND, weight_s_VD, h_t_NE, weight_t_VE)
        ctx.beta, ctx.chunk = beta, chunk
        return torch.cat(jsd) if jsd else h_s_ND.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_N):
        h_s_ND, weight_s_VD, h_t_NE, weight_t_VE = ctx.saved_tensors
        beta, chunk = ctx.beta, ctx.chunk

        def grad_logits():
            for hs, ht, g_C in zip(h_s_ND.split(chunk), h_t_NE.split(chunk), grad_N.split(chunk)):
                logp_s = _log_probs(hs, weight_s_VD)
                # dJSD/dp_s(v) = (1 - beta) log(p_s(v) / m(v)); through the softmax,
                # dJSD/dz(v) = p_s(v) (g(v) - sum_u p_s(u) g(u)).
                g_CV = (logp_s - _log_mixture(logp_s, _log_probs(ht, weight_t_VE), beta)).mul_(1.0 - beta)
                p_s = logp_s.exp_()
                g_CV.sub_((p_s * g_CV).sum(-1, keepdim=True))
                yield g_CV.mul_(p_s).mul_(g_C[:, None])

        grad_h, grad_w = linear_backward(ctx.needs_input_grad[:2], h_s_ND, weight_s_VD, chunk, grad_logits())
        return grad_h, grad_w, None, None, None, None


def chunked_jsd(
    h_s_ND: torch.Tensor,
    weight_s_VD: torch.Tensor,
    h_t_NE: torch.Tensor,
    weight_t_VE: torch.Tensor,
    beta: float,
    chunk: int,
) -> torch.Tensor:
    """JSD_beta(p_T || p_s) [N] for N positions, differentiable in the student's inputs, with at
    most `chunk` x vocab logits of each model alive at once."""
    return _ChunkedJSD.apply(h_s_ND, weight_s_VD, h_t_NE.detach(), weight_t_VE.detach(), beta, chunk)


def completion_hidden_states(model: Transformer, batch: TensorDict) -> torch.Tensor:
    """Final hidden states [N, D] at the loss mask's positions (row-major), padded or packed as
    the batch is planned (`data.packing.layout_of`), in the order `forward_logprobs` uses."""
    tokens_BT, mask_BT = batch["tokens"], batch["loss_mask"]
    layout = layout_of(batch, "off")
    if layout is None:
        return model.hidden_states(tokens_BT[:, :-1])[mask_BT > 0]
    backend = packed_backend(layout, tokens_BT.device, invariant=False)
    h_RSD = model.hidden_states(layout.pack(tokens_BT[:, :-1]), layout.positions_RS.to(tokens_BT.device), backend)
    return h_RSD[layout.pack(mask_BT) > 0]


# ---- the teacher and the recipe's hooks ----


def build_teacher(folder: str, trainer: TrainerHost) -> Transformer:
    """The frozen teacher from an HF folder, with its own shape, on the trainer's mesh."""
    args = read_hf_config(folder)
    student = trainer.model_args
    if args.num_labels != 0:
        raise ValueError(
            f"distillation.teacher_hf_checkpoint '{folder}' is a {args.num_labels}-label score model; "
            "the teacher must be a causal LM (*ForCausalLM)"
        )
    # Models of one tokenizer pad their vocabularies differently (Qwen2.5-7B 152,064, 0.5B 151,936):
    # sampled-token logprobs need only the student's ids; the full-vocabulary JSD needs equal sizes.
    jsd = trainer.config.distillation.divergence == "jsd"
    if args.vocab_size < student.vocab_size or (jsd and args.vocab_size != student.vocab_size):
        raise ValueError(
            f"distillation.teacher_hf_checkpoint '{folder}' has vocab_size {args.vocab_size}, the student "
            f"{student.vocab_size}; the teacher must share the student's tokenizer and vocabulary (a larger, "
            "padded teacher vocabulary is accepted with divergence = 'reverse_kl')"
        )
    # Positions beyond the teacher's own table would index past its RoPE cache; the student's
    # sequences are what it scores.
    args = replace(args, max_seq_len=max(args.max_seq_len, student.max_seq_len))
    return build_model(
        args, trainer.dims, trainer.config, trainer.device, hf_checkpoint=folder, float8=False
    ).requires_grad_(False)


def check_distillation(config: JobConfig, algorithm: Algorithm, trainer: TrainerHost) -> None:
    """Reject what distillation cannot run with, naming the fix."""
    name = config.algorithm.name
    if not algorithm.token_advantages:
        raise ValueError(
            f"[distillation] gives per-token advantages [B, T], but algorithm '{name}' takes one advantage per "
            "sequence (GSPO's sequence ratio); use a token-level one (grpo, rloo, cispo, sapo, ppo, ...), or unset "
            "distillation.teacher_hf_checkpoint"
        )
    if config.rollout.dynamic_sampling:
        raise ValueError(
            "[distillation] rollout.dynamic_sampling drops groups of equal task reward, which still "
            "carry the teacher's signal: set rollout.dynamic_sampling = false"
        )
    sharded = trainer.dims.world_size > 1 or isinstance(trainer.model, FSDPModule)
    if config.distillation.divergence == "jsd" and sharded:
        raise ValueError(
            "[distillation] divergence = 'jsd' reads the student's hidden states outside `model.logprobs`, which "
            "FSDP2 / TP do not gather yet: run it on 1 rank with training.mixed_precision_param = 'float32', or use "
            "divergence = 'reverse_kl'"
        )


@dataclasses.dataclass
class DistillStats:
    """A step's distillation sums: a base of the RL recipe's `StepStats` (reduced with it)."""

    distill_tokens: float = 0.0
    distill_log_ratio: float = 0.0
    teacher_logprob: float = 0.0
    jsd_tokens: float = 0.0
    jsd: float = 0.0

    def distill_metrics(self) -> dict[str, float]:
        """Per completion token: distill_reverse_kl (the k1 estimate log pi_s - log pi_T on the
        student's samples), teacher_logprob, and distill_jsd when the JSD loss ran."""
        n = max(self.distill_tokens, 1.0)
        out = {"distill_reverse_kl": self.distill_log_ratio / n, "teacher_logprob": self.teacher_logprob / n}
        if self.jsd_tokens:
            out["distill_jsd"] = self.jsd / self.jsd_tokens
        return out


class Distiller:
    """The teacher and what the RL recipe asks of it: logprobs, mixed advantages, the JSD loss."""

    def __init__(self, config: JobConfig, teacher: Transformer) -> None:
        self.config = config.distillation
        self.teacher = teacher
        self.invariant, self.chunk = config.generator.batch_invariant, config.training.logprob_chunk_tokens
        self.packing = config.training.packing

    @torch.no_grad()
    def add_teacher_logprobs(self, batch: TensorDict) -> None:
        """batch["teacher_logprobs"] [B, T-1]: the teacher's log pi_T of each next token, as the
        reference's are computed (packed or padded, the loss mask's positions only)."""
        batch["teacher_logprobs"], _ = forward_logprobs(
            self.teacher, batch, self.invariant, self.chunk, packing=self.packing
        )

    @torch.no_grad()
    def advantages(self, task_advantages: torch.Tensor, batch: TensorDict, stats: DistillStats) -> torch.Tensor:
        """The mixed per-token advantages [B, T-1] (module docstring); the JSD enters the loss instead."""
        mask_BT, teacher_BT = batch["loss_mask"], batch["teacher_logprobs"]
        # The sampled tokens' student logprobs: the trainer's when computed (off-policy), else the generator's.
        student_BT = batch["old_logprobs"] if "old_logprobs" in batch.keys() else batch["gen_logprobs"]
        distill_BT = distillation_advantages(student_BT, teacher_BT, mask_BT)
        stats.distill_tokens += mask_BT.sum().item()
        stats.distill_log_ratio -= distill_BT.sum().item()
        stats.teacher_logprob += (teacher_BT * mask_BT).sum().item()
        coef = self.config.coef if self.config.divergence == "reverse_kl" else 0.0
        return mix_advantages(task_advantages, distill_BT, mask_BT, coef, self.config.task_reward_coef)

    def loss(
        self, policy: Transformer, mb: TensorDict, num_global_tokens: float, stats: DistillStats
    ) -> torch.Tensor | float:
        """coef * sum of JSD_t over the micro-batch's completion tokens / global completion tokens
        (token-mean over the global batch), or 0 unless divergence = 'jsd'."""
        if self.config.divergence != "jsd":
            return 0.0
        with torch.no_grad():
            h_t_NE = completion_hidden_states(self.teacher, mb)
        h_s_ND = completion_hidden_states(policy, mb)
        jsd_N = chunked_jsd(
            h_s_ND, policy.output.weight, h_t_NE, self.teacher.output.weight, self.config.jsd_beta, self.chunk
        )
        stats.jsd += jsd_N.detach().sum().item()
        stats.jsd_tokens += jsd_N.numel()
        return self.config.coef * jsd_N.sum() / num_global_tokens


def build_distiller(config: JobConfig, algorithm: Algorithm, trainer: TrainerHost) -> Distiller | None:
    """The distiller when distillation.teacher_hf_checkpoint is set (after the checks), else None."""
    folder = config.distillation.teacher_hf_checkpoint
    if not folder:
        return None
    check_distillation(config, algorithm, trainer)
    return Distiller(config, build_teacher(folder, trainer))

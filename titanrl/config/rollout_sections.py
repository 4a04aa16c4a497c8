"""The `[rollout]` section: how generation overlaps training (partial rollouts, one-step
off-policy on disaggregated ranks). A docstring under every field; `validate()` checks them."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Rollout:
    mode: Literal["colocated", "one_step"] = "colocated"
    """'colocated': every rank generates, then trains (the default; the bitwise-parity path).
    'one_step': the torchrun world is split into `rollout_ranks` ranks that only generate and
    score, and as many trainer ranks (rollout rank i feeds trainer rank i); rollout ranks generate
    batch k+1 while trainer ranks train on batch k, and get the new weights from their trainer
    rank after each step (a copy over a process group, no files)."""

    rollout_ranks: int = 1
    """one_step: ranks that generate; the world must hold twice as many (the rest train)."""

    staleness: int = 1
    """one_step: weight versions a batch may lag behind the trainer when trained on: 1 overlaps
    generation with training; 0 makes rollout ranks wait for the latest weights (the same
    samples and updates as a synchronous run, without overlap)."""

    partial: bool = False
    """Partial rollouts (colocated): a step decodes more groups than it trains (`oversample`) and
    ends generation as soon as this rank's share of training.batch_size groups is complete
    (those are trained on); samples still decoding are paused (KV blocks freed;
    their tokens, behaviour logprobs and weight versions kept) and continue in the next step under
    the new weights, beside that step's new prompts. Only complete groups are trained on; each
    token's behaviour logprob is the one of the weights that sampled it, and the off-policy
    correction (algorithm.off_policy_correction 'tis' or 'mis') weighs it. Paused samples are
    saved in checkpoints (a resume with the same data-parallel and TP layout continues them)."""

    oversample: float = 2.0
    """Partial rollouts: groups decoding together, as a multiple of this rank's share of
    training.batch_size (new prompts join the groups in flight until there are that many). The
    larger, the less a step waits for long responses, and the staler their first tokens."""

    max_step_tokens: int = 0
    """Partial rollouts: decode tokens a rank may generate in one step before it pauses with
    fewer complete groups than its share (once at least one group is complete); 0: no cap."""

    max_staleness: int = 0
    """Partial rollouts: a group in flight whose oldest token is more than this many weight
    versions behind the current weights is restarted from its prompt (its tokens discarded,
    counted in 'restarted_groups'); 0: no bound."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal under a group
    baseline) and sample more prompts until the batch is full."""

    max_sampling_rounds: int = 4
    """Cap on generation rounds per step with dynamic_sampling; if the batch is still short, it
    is filled with dropped groups (zero advantage), counted in the 'sampling_short_groups' metric."""

    overlong_filter: bool = False
    """DAPO's overlong filtering: truncated completions (no stop within generator.max_new_tokens)
    are masked out of the loss."""

    def validate(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ValueError(f"[rollout] max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.max_step_tokens < 0:
            raise ValueError(f"[rollout] max_step_tokens must be >= 0, got {self.max_step_tokens}")
        if self.rollout_ranks < 1:
            raise ValueError(f"[rollout] rollout_ranks must be >= 1, got {self.rollout_ranks}")
        if self.staleness not in (0, 1):
            raise ValueError(f"[rollout] staleness must be 0 or 1 (one-step off-policy), got {self.staleness}")
        if self.mode == "one_step" and self.partial:
            raise ValueError("[rollout] partial = true is for mode = 'colocated', not 'one_step'")
        if self.max_staleness < 0:
            raise ValueError(f"[rollout] max_staleness must be >= 0 (0 = no bound), got {self.max_staleness}")
        if not self.oversample >= 1.0:
            raise ValueError(f"[rollout] oversample must be >= 1, got {self.oversample}")

"""Generation: `[generator]` (the in-process paged generator and its sampling) and
`[rollout]` (how generation overlaps training: partial rollouts, one-step off-policy on
disaggregated ranks, dynamic sampling). A docstring under every field; each section checks its own
fields in `validate()`."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Generator:
    block_size: int = 16
    """Tokens per paged KV-cache block."""

    kv_cache_memory_fraction: float = 0.3
    """Fraction of free device memory given to the KV block pool while generating."""

    max_num_seqs: int = 256
    """Most sequences decoded together in one continuous batch."""

    max_new_tokens: int = 64
    """Most tokens generated per sample."""

    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""

    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]; 1 disables it."""

    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""

    num_blocks: int = 0
    """KV-cache blocks in the pool; 0 sizes the pool from kv_cache_memory_fraction."""

    enable_prefix_caching: bool = True
    """Reuse cached K/V of full prompt blocks across requests (group samples always share)."""

    compile: bool | None = None
    """Compile the prefill attention and the decode step (power-of-two batch buckets; CUDA graphs
    on GPU); unset: on for CUDA, off on CPU. The compiled code is cached under
    `<job.dump_folder>/compile_cache`, so a restarted or resumed job does not compile from scratch."""

    batch_invariant: bool = False
    """Batch-invariant kernels in generator and trainer: bitwise-equal logprobs, much slower."""

    max_num_batched_tokens: int = 4096
    """Most prompt tokens prefilled in one scheduler step: a longer prompt is prefilled in chunks of
    at most this many tokens over several steps (`enable_chunked_prefill`), or alone if that is off."""

    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """`torch.compile` backend when `compile` is on. FlexAttention needs 'inductor'; the others
    (for debugging the compile of the rest of the step) attend over gathered pages."""

    attention_impl: Literal["auto", "exact"] = "auto"
    """Paged attention. 'auto': FlexAttention over the pages, compiled (prefill and decode; its
    block mask built on device from the block tables), wherever inductor compiles it: CUDA, or
    `compile` on CPU; an eager CPU run (and a non-inductor compile_backend) attends over gathered
    copies of the pages with SDPA instead. 'exact': the batch-invariant attention
    (models/batch_invariant.py), which batch_invariant implies."""

    quantize: Literal["none", "int8", "fp8"] = "none"
    """Quantise the generator's block linears with torchao at every sync ('int8': weight-only, CPU and GPU;
    'fp8': float8, CUDA capability >= 8.9; not with tp > 1); embedding, LM head and trainer keep full precision:
    gen_logprob_diff / mismatch_kl show the sampler/trainer gap, algorithm.off_policy_correction corrects it."""

    decode_steps_per_schedule: int = 32
    """Decode steps run on device between two scheduler passes (KV blocks reserved ahead, one
    small host read per step, tokens read once per pass); 1 schedules every step."""

    enable_chunked_prefill: bool = True
    """Prefill a prompt longer than max_num_batched_tokens in chunks, one per scheduler step, each
    attending to the K/V earlier chunks left in its blocks, with a decode pass of the running
    samples after each chunk: prefill activations stay bounded by the chunk and decoding never
    stalls behind a long prompt. Off: a longer prompt is prefilled alone in one forward."""

    def validate(self) -> None:
        if self.attention_impl not in ("auto", "exact"):
            raise ValueError(
                f"[generator] attention_impl must be 'auto' (FlexAttention, compiled) or 'exact' "
                f"(batch-invariant), got '{self.attention_impl}' ('sdpa', 'flex', 'inplace' and "
                "'cpu_kernel' were merged into 'auto')"
            )
        if self.num_blocks < 0:
            raise ValueError(f"[generator] num_blocks must be >= 0 (0 = from memory), got {self.num_blocks}")
        if self.compile and self.batch_invariant:
            raise ValueError("[generator] compile and batch_invariant cannot be combined; pick one")
        if self.quantize != "none" and self.batch_invariant:
            raise ValueError(f"[generator] quantize='{self.quantize}' and batch_invariant cannot be combined; pick one")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_new_tokens",
            "max_num_batched_tokens",
            "decode_steps_per_schedule",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"[generator] {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"[generator] kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.temperature < 0:
            raise ValueError(f"[generator] temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"[generator] top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"[generator] top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass
class Rollout:
    mode: Literal["colocated", "one_step", "async"] = "colocated"
    """'colocated': every rank generates, then trains (the default; the bitwise-parity path).
    'one_step': the torchrun world is split into `rollout_ranks` ranks that only generate and
    score, and as many trainer ranks (rollout rank i feeds trainer rank i); rollout ranks generate
    batch k+1 while trainer ranks train on batch k, and get the new weights from their trainer
    rank after each step (a copy over a process group, no files).
    'async': `rollout_ranks` ranks decode a continuous stream and the other ranks train (any
    ratio); finished groups go to the trainer as they complete, a step trains the next
    batch_size of them within `max_staleness` versions, and new weights are broadcast in buckets
    and swapped in between two decode steps, the samples in flight kept (docs/async.md)."""

    rollout_ranks: int = 1
    """one_step / async: ranks that generate (the first ones). one_step: the world must hold twice
    as many; async: every other rank trains."""

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
    """async: k, the most weight versions a trained token may lag behind the weights it is
    trained from (0: the synchronous run's samples and updates; 1-2: most of the overlap).
    Partial rollouts: a group in flight whose oldest token is more than this many weight
    versions behind the current weights is restarted from its prompt (its tokens discarded,
    counted in 'restarted_groups'); 0: no bound."""

    stale_groups: Literal["wait", "drop"] = "wait"
    """async: how the max_staleness bound is kept. 'wait': rollout ranks start no group that could
    not be trained in time and take new weights only once the groups due before them are sent (the
    trainer may wait for that; no group is wasted). 'drop': weights are taken as soon as they come,
    and the trainer drops the groups older than the bound (counted in 'groups_dropped')."""

    tp: int = 1
    """async: rollout ranks that serve one generator, its weights sharded over them (tensor
    parallel; a rollout group). rollout_ranks must be a multiple, and it must divide the model's
    heads as parallelism.tp does."""

    weight_bucket_mb: float = 256.0
    """async: weights cross to the rollout ranks in broadcasts of about this many MB (in the
    generator's dtype); the trainer gathers its shards one bucket at a time."""

    recompute_kv: bool = False
    """async: after a weight swap, prefill the samples in flight again under the new weights
    (their K/V recomputed) instead of keeping their older tokens' K/V (PipelineRL's default)."""

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
        if self.mode != "colocated" and self.partial:
            raise ValueError(f"[rollout] partial = true is for mode = 'colocated', not '{self.mode}'")
        if self.tp < 1:
            raise ValueError(f"[rollout] tp must be >= 1, got {self.tp}")
        if self.tp > 1 and self.mode != "async":
            raise ValueError("[rollout] tp > 1 shards the generator of a rollout group: it needs mode = 'async'")
        if not self.weight_bucket_mb > 0:
            raise ValueError(f"[rollout] weight_bucket_mb must be > 0, got {self.weight_bucket_mb}")
        if self.max_staleness < 0:
            raise ValueError(f"[rollout] max_staleness must be >= 0 (0 = no bound), got {self.max_staleness}")
        if not self.oversample >= 1.0:
            raise ValueError(f"[rollout] oversample must be >= 1, got {self.oversample}")

"""Sections of the job configuration that the RL recipe reads: the generator, the algorithm,
the critic, rewards, environments, and the SFT warm-up before RL; and the DPO recipe's section.
([rollout] is in rollout_sections.py.)"""

from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_FORMATS = ("tag", "hermes", "llama3", "auto")
"""The values of [env] tool_format (envs/tool_calls.py reads them; 'auto' picks from the template)."""


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

    off_policy_correction: Literal["none", "tis", "mis"] = "none"
    """Importance weights pi_trainer / pi_generator on the loss: 'tis' truncates them at
    is_cap, 'mis' drops tokens whose ratio is outside [1/is_cap, is_cap]."""

    is_cap: float = 2.0
    """Cap C of the off-policy importance ratio (tis, mis)."""

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
class Reward:
    timeout_s: float = 60.0
    """Wall-clock seconds that one batch's reward calls may take together (a batch: the completions
    scored together on this rank, i.e. a sampling round's, ReMax's greedy baseline's, or the
    evaluation's), counted once the workers have loaded the function. A hung call holds one
    worker while the others go on; at the deadline every unfinished sample, running or still
    queued, gets the failure reward ('timeout') and only the workers busy with one are replaced.
    Size it as samples per batch / num_workers x the slowest legitimate call, with room to spare:
    a hang then costs a step at most this long."""

    failure_reward: float = 0.0
    """Reward given to a sample whose reward function raised, hung, ran out of memory, killed its
    worker or returned a non-finite value (counted by reason: reward_failures_<reason>)."""

    num_workers: int = 2
    """Worker processes that run reward functions, each under a keeper that kills whatever the
    function started (plain, `setsid` and double-forked children) with its worker, in the worker's
    own cgroup where the machine allows it (docs/reliability.md, "Containment")."""

    memory_limit_mb: int = 2048
    """Memory limit of each reward worker: its address space (a runaway reward function gets
    MemoryError) and, with a memory cgroup, the resident memory of everything it started. A sample
    over it fails as 'memory' and the worker is replaced; 0 means no limit."""

    function: str = ""
    """Your reward function as 'module:callable', called as f(prompt, completion, metadata) and
    returning a float or {'reward': float, 'correct': bool}; empty uses the task's verifier. What it
    prints goes to <job.dump_folder>/reward_output.log (the first 4 kB per sample), not the console."""

    verifier_weight: float = 1.0
    """Weight of the verifier / reward function in the total reward."""

    model_path: str = ""
    """A reward model: HF folder of a *ForSequenceClassification with one label (e.g. written by
    the 'reward_model' offline recipe), sharing the policy's tokenizer; scored on the same mesh."""

    model_weight: float = 1.0
    """Weight of the reward model's score in the total reward."""

    streaming: bool = True
    """Score each sample as soon as it finishes, in the workers, while the other samples decode
    (single-turn rollouts); the step then waits only for what is left (timeout_s counts from
    there). Off: the batch is scored once generation has ended. Same rewards either way."""

    overlong_buffer_len: int = 0
    """DAPO's overlong reward shaping: completions longer than generator.max_new_tokens minus this
    get a linear penalty reaching -overlong_penalty_factor at max_new_tokens; 0 disables it."""

    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty."""

    def validate(self) -> None:
        for name in ("overlong_buffer_len", "overlong_penalty_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"[reward] {name} must be >= 0, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"[reward] timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"[reward] num_workers must be >= 1, got {self.num_workers}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"[reward] memory_limit_mb must be >= 0 (0 = no limit), got {self.memory_limit_mb}")
        if self.verifier_weight == 0 and not self.model_path:
            raise ValueError("[reward] verifier_weight is 0 and no model_path is set: nothing gives a reward")


@dataclass
class Env:
    name: str = ""
    """Multi-turn environment: '' for single-turn tasks, a built-in env ('calculator', 'python',
    'guess_number'; pair it with the same data.task) or your 'module:Class' (see titanrl/envs/base.py)."""

    max_turns: int = 4
    """Most model turns per episode."""

    max_total_tokens: int = 192
    """Most completion tokens (model and environment) per episode; generator.max_new_tokens is per turn."""

    num_workers: int = 2
    """Worker processes that run environment episodes."""

    timeout_s: float = 10.0
    """Seconds one reset/step call may take before its episode fails (and its worker is replaced)."""

    observation_role: str = "user"
    """With data.chat_template: the role of the environment's observations in the conversation
    ('user', or 'tool' for tool results, which the template renders as such); without a template
    observations are appended as raw tokens and this is unused."""

    tool_format: str = "tag"
    """How the model writes tool calls: 'tag' (titanrl's `<tool>...</tool>`), or a chat template's own
    format, 'hermes' (Qwen2.5 / Qwen3 / Hermes `<tool_call>{json}</tool_call>`) or 'llama3' (Llama 3.1 /
    3.2 JSON calls), or 'auto' (read from data.chat_template's template). Not 'tag': the env's tools go to
    the template as `tools` and results render through its tool role (see docs/tool_calls.md)."""

    servers: int = 0
    """Local OpenEnv-compatible servers of env.name that `titanrl run` starts on 127.0.0.1 for
    each rank (`titanrl serve-env`, stopped with the run); episodes then run against them instead
    of in worker processes (docs/env_servers.md)."""

    urls: list[str] = field(default_factory=list)
    """External OpenEnv servers ('http://host:port'), shared least-loaded with the local ones;
    env.name still names the environment whose stop_strings end a model turn."""

    action_field: str = "text"
    """With servers: the action's field that carries the model's turn (OpenEnv's echo env: 'message')."""

    observation_field: str = "text"
    """With servers: the observation's str field appended to the conversation; its other fields
    are the step's info (e.g. 'correct', 'tool_call')."""

    reset_retries: int = 2
    """With servers: retries of a failed reset on the next server (a step is never retried)."""

    token_file: str = ""
    """With servers: a file whose first line is the shared token sent to them (else the
    TITANRL_ENV_TOKEN environment variable; never the token itself in the config)."""

    startup_timeout_s: float = 60.0
    """With servers: seconds to wait for each to answer /health at start before the run fails."""

    verifiers: str = ""
    """A `verifiers` environment whose harness plays the episodes, the policy answering its model
    requests: a taskset id (an installed package exporting a `verifiers.v1.Taskset`, and its
    `Harness`) or 'module:factory' returning a `verifiers.v1.SingleAgentEnvConfig`; its rewards
    are verifiers' own scoring. env.name still names the environment whose stop_strings end a
    model turn (docs/env_servers.md)."""

    def validate(self) -> None:
        if self.verifiers and (self.servers or self.urls):
            raise ValueError(
                f"[env] verifiers = {self.verifiers!r} runs its own harnesses: unset servers / urls, or verifiers"
            )
        if self.verifiers and not self.name:
            raise ValueError("[env] verifiers needs env.name (the environment, for its stop_strings)")
        if self.servers < 0 or self.reset_retries < 0:
            raise ValueError(f"[env] servers and reset_retries must be >= 0, got {self.servers}, {self.reset_retries}")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"[env] urls: {url!r} must start with http:// or https://")
        if (self.servers or self.urls) and not self.name:
            raise ValueError("[env] servers / urls need env.name (the environment, for its stop_strings)")
        for name in ("max_turns", "max_total_tokens", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"[env] {name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"[env] timeout_s must be > 0, got {self.timeout_s}")
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"[env] observation_role must be 'user' or 'tool', got {self.observation_role!r}")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"[env] tool_format must be one of {TOOL_FORMATS}, got {self.tool_format!r}")


@dataclass
class SFTWarmup:
    steps: int = 0
    """Supervised steps on worked solutions before RL (the 'sft' recipe's step), so that a model
    trained from scratch can start; skipped when the run resumes from a checkpoint."""

    lr: float = 1e-3
    """Learning rate of the warm-up (constant; its own AdamW, not [optimizer]'s)."""

    batch_size: int = 64
    """Global sequences per warm-up step."""

    beta1: float = 0.9
    """Adam beta1 of the warm-up optimizer."""

    beta2: float = 0.99
    """Adam beta2 of the warm-up optimizer."""

    weight_decay: float = 0.0
    """Weight decay of the warm-up optimizer."""

    seed_offset: int = 7919
    """The warm-up's data order is seeded with job.seed + seed_offset, so that it differs from
    the RL prompts' order."""

    def validate(self) -> None:
        if self.steps < 0:
            raise ValueError(f"[sft_warmup] steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"[sft_warmup] lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"[sft_warmup] batch_size must be >= 1, got {self.batch_size}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"[sft_warmup] {name} must be in [0, 1), got {getattr(self, name)}")


@dataclass
class DPO:
    beta: float = 0.1
    """DPO's beta: strength of the implicit KL to the reference (the starting policy)."""

    label_smoothing: float = 0.0
    """Conservative-DPO label smoothing in [0, 0.5): assumed fraction of flipped preferences."""

    def validate(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"[dpo] beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"[dpo] label_smoothing must be in [0, 0.5), got {self.label_smoothing}")

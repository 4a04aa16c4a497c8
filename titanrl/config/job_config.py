"""The job configuration: one dataclass per TOML section, a docstring under every field.

Precedence is CLI > TOML > the defaults written here. Loading and validation live in
`titanrl/config/manager.py`; cross-field checks live next to the section they concern, in its
`validate()` method, so a reader finds the rule beside the field.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    config_file: str = ""
    """TOML file with the job configuration; values given on the command line override it."""

    dump_folder: str = "./outputs"
    """Folder for everything the run writes: metrics, checkpoints, exported models."""

    description: str = "titanrl job"
    """Free-text description, printed at start-up and stored with the metrics."""

    seed: int = 0
    """Seed for model init, data order and sampling; the same seed gives the same run."""

    deterministic: bool = False
    """Use deterministic kernels (`torch.use_deterministic_algorithms`); slower, bitwise repeatable."""

    print_config: bool = False
    """Print the resolved configuration as TOML on rank 0 at start-up."""

    phase_timeout_s: float = 0.0
    """Watchdog: a phase (sync, generate, reward, logprob, train, eval, checkpoint) running longer
    than this ends the process with a message naming the rank and phase; 0 disables it."""

    def validate(self) -> None:
        if self.phase_timeout_s < 0:
            raise ValueError(f"[job] phase_timeout_s must be >= 0 (0 = off), got {self.phase_timeout_s}")
        if self.seed < 0:
            raise ValueError(f"[job] seed must be >= 0, got {self.seed}")


@dataclass
class Model:
    flavor: str = "debug"
    """Named model shape from the registry (`titanrl.models.flavors`), e.g. 'debug', 'qwen3-0.6b'."""

    hf_checkpoint: str = ""
    """Hugging Face folder (config.json + safetensors) to load; empty trains the flavor from scratch."""

    tokenizer: str = "byte"
    """'byte' for the built-in byte tokenizer, or a folder holding a Hugging Face tokenizer.json."""

    max_seq_len: int = 0
    """Override of the flavor's maximum sequence length (RoPE table size); 0 keeps the flavor's."""

    def validate(self) -> None:
        if self.max_seq_len < 0:
            raise ValueError(f"[model] max_seq_len must be >= 0 (0 = flavor default), got {self.max_seq_len}")


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dimension): each replica holds a full copy, sharded by dp_shard."""

    dp_shard: int = -1
    """FSDP2 shard degree; -1 takes whatever the world size leaves after dp_replicate and tp."""

    tp: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding with sequence parallelism)."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 resharding: 'default' reshards every block but the root, 'always'/'never' force it."""

    def validate(self) -> None:
        for name in ("dp_replicate", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"[parallelism] {name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"[parallelism] dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}")


@dataclass
class Training:
    steps: int = 100
    """Number of optimizer steps."""

    batch_size: int = 16
    """Global number of prompts per RL step (each sampled algorithm.group_size times), split across dp ranks."""

    micro_batch_tokens: int = 0
    """Token budget of one forward/backward (gradient accumulation) in RL updates, SFT warm-up
    and the offline recipes: sequences are sorted by length and split into about
    padded tokens / budget micro-batches, as many on every dp rank (a preference pair stays in
    one); 0 = the whole mini-batch."""

    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; 0 disables clipping."""

    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype of parameters in forward/backward under FSDP2 (master weights stay float32)."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under FSDP2."""

    warmup_sft_steps: int = 0
    """Supervised steps on generated solutions before RL, so a model trained from scratch can start."""

    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient norm: 'skip' drops that update (counted in metrics), 'stop' ends the run."""

    warmup_sft_lr: float = 1e-3
    """Learning rate of the SFT warm-up (constant, AdamW)."""

    warmup_sft_batch_size: int = 64
    """Global sequences per SFT warm-up step."""

    def validate(self) -> None:
        if not self.warmup_sft_lr > 0:
            raise ValueError(f"[training] warmup_sft_lr must be > 0, got {self.warmup_sft_lr}")
        if self.warmup_sft_batch_size < 1:
            raise ValueError(f"[training] warmup_sft_batch_size must be >= 1, got {self.warmup_sft_batch_size}")
        for name in ("steps", "warmup_sft_steps", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"[training] {name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"[training] batch_size must be >= 1, got {self.batch_size}")
        if self.max_norm < 0:
            raise ValueError(f"[training] max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    """Optimizer class from `torch.optim`."""

    lr: float = 1e-5
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1 (ignored by SGD)."""

    beta2: float = 0.95
    """Adam beta2 (ignored by SGD)."""

    eps: float = 1e-8
    """Adam epsilon (ignored by SGD)."""

    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (Adam, SGD)."""

    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """Kernel style of the optimizer step; 'fused' needs a device that supports it."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"[optimizer] lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"[optimizer] {name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"[optimizer] weight_decay must be >= 0, got {self.weight_decay}")


@dataclass
class LRScheduler:
    warmup_steps: int = 0
    """Steps of linear warm-up from lr * 1/(warmup_steps+1) to lr."""

    decay_type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay after warm-up, down to lr * min_lr_factor at the last step."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of the peak (for 'linear' and 'cosine')."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"[lr_scheduler] warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ValueError(f"[lr_scheduler] min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """'full' recomputes each block in backward; 'selective' recomputes per `selective_ac_option`."""

    selective_ac_option: str = "op"
    """'op': save matmul/attention outputs and recompute the rest; an integer N: checkpoint every Nth block."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        if self.mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ValueError(
                f"[activation_checkpoint] selective_ac_option must be 'op' or a positive integer, got '{opt}'"
            )


@dataclass
class Compile:
    enable: bool = False
    """Compile each transformer block with `torch.compile(fullgraph=True)`."""

    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """`torch.compile` backend; 'aot_eager' is a fast-to-compile debugging aid."""


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

    compile: bool = False
    """Compile the decode step (power-of-two batch buckets; CUDA graphs on GPU)."""

    batch_invariant: bool = False
    """Batch-invariant kernels in generator and trainer: bitwise-equal logprobs, much slower."""

    attention_impl: Literal["sdpa", "flex"] = "sdpa"
    """Paged attention: 'sdpa' gathers pages then runs SDPA (portable); 'flex' runs FlexAttention
    with a block mask over the pages (the fast path on GPU; correct but slow on CPU)."""

    def validate(self) -> None:
        if self.num_blocks < 0:
            raise ValueError(f"[generator] num_blocks must be >= 0 (0 = from memory), got {self.num_blocks}")
        if self.compile and self.batch_invariant:
            raise ValueError("[generator] compile and batch_invariant cannot be combined; pick one")
        for name in ("block_size", "max_num_seqs", "max_new_tokens"):
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
    name: Literal["grpo", "rloo", "remax", "reinforce_pp", "gspo", "ppo"] = "grpo"
    """Advantage estimator and policy loss, one file each under `titanrl/algorithms/`: 'grpo'
    (group mean/std; also Dr.GRPO and DAPO, see their recipes), 'rloo' (leave-one-out),
    'remax' (baseline: reward of one extra greedy completion per prompt), 'reinforce_pp'
    (globally whitened token returns), 'gspo' (sequence-level ratio), 'ppo' (GAE with a learned
    critic: needs [critic] enable = true)."""

    group_size: int = 8
    """Samples generated per prompt; advantages are normalised within each group."""

    clip_eps_low: float = 0.2
    """Lower PPO clip range: ratios below 1 - clip_eps_low are clipped."""

    clip_eps_high: float = 0.2
    """Upper PPO clip range (clip-higher when larger than clip_eps_low)."""

    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 skips the reference model."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3) used for the penalty."""

    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number: over all tokens, per sequence then mean, or Dr.GRPO."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group std (off for Dr.GRPO)."""

    kl_in_reward: bool = False
    """Put the KL penalty in the reward instead of the loss: per token for 'ppo' and
    'reinforce_pp', as kl_coef * (sequence KL) subtracted from the reward otherwise."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""

    num_minibatches: int = 1
    """Optimizer steps per pass; more than one (or several epochs) makes later updates off-policy."""

    gamma: float = 1.0
    """Discount of token rewards ('ppo' GAE, 'reinforce_pp' returns)."""

    lam: float = 1.0
    """GAE lambda ('ppo')."""

    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full."""

    max_sampling_rounds: int = 4
    """Cap on generation rounds per step with dynamic_sampling; if the batch is still short, it
    is filled with dropped groups (zero advantage), counted in the 'sampling_short_groups' metric."""

    overlong_buffer_len: int = 0
    """DAPO overlong shaping: completions longer than max_new_tokens - this get a linear penalty
    reaching -overlong_penalty_factor at max_new_tokens; 0 disables it."""

    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty."""

    overlong_filter: bool = False
    """DAPO overlong filtering: truncated completions (no stop within max_new_tokens) are masked
    out of the loss."""

    off_policy_correction: Literal["none", "tis", "mis"] = "none"
    """Importance weights pi_trainer / pi_generator on the loss: 'tis' truncates them at
    is_cap, 'mis' drops tokens whose ratio is outside [1/is_cap, is_cap]."""

    is_cap: float = 2.0
    """Cap C of the off-policy importance ratio (tis, mis)."""

    def validate(self) -> None:
        for name in ("ppo_epochs", "num_minibatches", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"[algorithm] {name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 1:
            raise ValueError(f"[algorithm] group_size must be >= 1, got {self.group_size}")
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "overlong_buffer_len", "overlong_penalty_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"[algorithm] {name} must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"[algorithm] {name} must be in [0, 1], got {getattr(self, name)}")
        if not self.is_cap > 1.0:
            raise ValueError(f"[algorithm] is_cap must be > 1, got {self.is_cap}")
        if self.name == "rloo" and self.group_size < 2:
            raise ValueError("[algorithm] 'rloo' needs group_size >= 2 (the baseline leaves one sample out)")
        if self.name == "gspo" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                "[algorithm] 'gspo' clips one ratio per sequence and averages per sequence; set "
                "loss_agg = 'seq-mean-token-mean'"
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("[algorithm] dynamic_sampling needs group_size >= 2 (it drops groups of equal rewards)")
        if self.dynamic_sampling and self.name in ("ppo", "reinforce_pp", "remax"):
            raise ValueError(
                f"[algorithm] dynamic_sampling drops groups with equal rewards, which only carry no "
                f"signal for group baselines ('grpo', 'rloo', 'gspo'), not for '{self.name}'"
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
    timeout_s: float = 5.0
    """Seconds a reward function may run on one sample before it counts as failed."""

    failure_reward: float = 0.0
    """Reward given to a sample whose reward function raised, hung or returned a non-finite value."""

    num_workers: int = 2
    """Worker processes that run reward functions."""

    memory_limit_mb: int = 2048
    """Address-space limit of each reward worker (a runaway reward function gets MemoryError,
    counted as a failure); 0 means no limit."""

    function: str = ""
    """Your reward function as 'module:callable', called as f(prompt, completion, metadata) and
    returning a float or {'reward': float, 'correct': bool}; empty uses the task's verifier."""

    verifier_weight: float = 1.0
    """Weight of the verifier / reward function in the total reward."""

    model_path: str = ""
    """A reward model: HF folder of a *ForSequenceClassification with one label (e.g. written by
    the 'reward_model' offline recipe), sharing the policy's tokenizer; scored on the same mesh."""

    model_weight: float = 1.0
    """Weight of the reward model's score in the total reward."""

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"[reward] timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"[reward] num_workers must be >= 1, got {self.num_workers}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"[reward] memory_limit_mb must be >= 0 (0 = no limit), got {self.memory_limit_mb}")
        if self.verifier_weight == 0 and not self.model_path:
            raise ValueError("[reward] verifier_weight is 0 and no model_path is set: nothing gives a reward")


@dataclass
class Data:
    task: str = "arithmetic"
    """Embedded task name (e.g. 'arithmetic'), or 'jsonl' to read prompts from `path`."""

    path: str = ""
    """Prompt file for task 'jsonl': one JSON object per line with 'prompt' and 'answer'."""

    num_eval_samples: int = 64
    """Held-out prompts used by the periodic greedy evaluation (task 'jsonl': the file's first
    rows, which are then not trained on)."""

    def validate(self) -> None:
        if self.task == "jsonl" and not self.path:
            raise ValueError("[data] task 'jsonl' needs data.path (a .jsonl file of prompts)")
        if self.num_eval_samples < 0:
            raise ValueError(f"[data] num_eval_samples must be >= 0, got {self.num_eval_samples}")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save sharded checkpoints with `torch.distributed.checkpoint`, and resume from the latest
    complete one in `folder` when the job starts (re-running the command resumes)."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 100
    """Save every this many RL steps (and at the last step)."""

    keep_latest_k: int = 2
    """Keep this many most recent checkpoints; 0 keeps all."""

    export_hf: bool = False
    """At the end of the run, write the policy as a Hugging Face folder to <dump_folder>/hf."""

    load_path: str = ""
    """Resume from this step-N checkpoint folder instead of the latest one in `folder` (e.g. to
    branch a run into a new dump_folder); empty resumes from the latest, if any."""

    def validate(self) -> None:
        if self.load_path and not self.enable:
            raise ValueError("[checkpoint] load_path needs checkpoint.enable = true")
        if self.interval < 1:
            raise ValueError(f"[checkpoint] interval must be >= 1, got {self.interval}")
        if self.keep_latest_k < 0:
            raise ValueError(f"[checkpoint] keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}")


@dataclass
class Metrics:
    log_freq: int = 1
    """Print and record metrics every this many steps."""

    eval_freq: int = 0
    """Run the greedy evaluation every this many steps; 0 only at the start and the end."""

    jsonl_file: str = "metrics.jsonl"
    """Metrics file (one JSON object per step), relative to job.dump_folder; empty disables it."""

    enable_wandb: bool = False
    """Also log to Weights & Biases (offline unless `wandb_mode` says otherwise)."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode when enabled; offline never needs a network."""

    def validate(self) -> None:
        if self.log_freq < 1:
            raise ValueError(f"[metrics] log_freq must be >= 1, got {self.log_freq}")
        if self.eval_freq < 0:
            raise ValueError(f"[metrics] eval_freq must be >= 0, got {self.eval_freq}")


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

    def validate(self) -> None:
        for name in ("max_turns", "max_total_tokens", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"[env] {name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"[env] timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class Offline:
    recipe: Literal["sft", "dpo", "reward_model"] = "sft"
    """What `python -m titanrl.train_offline` trains from data.path (JSONL): 'sft' on
    {prompt, completion} rows, 'dpo' and 'reward_model' (Bradley-Terry, a one-label score head)
    on {prompt, chosen, rejected} rows."""

    dpo_beta: float = 0.1
    """DPO's beta: strength of the implicit KL to the reference (the starting policy)."""

    label_smoothing: float = 0.0
    """Conservative-DPO label smoothing in [0, 0.5): assumed fraction of flipped preferences."""

    eval_freq: int = 20
    """Evaluate on the held-out rows (the first data.num_eval_samples) every this many steps."""

    def validate(self) -> None:
        if not self.dpo_beta > 0:
            raise ValueError(f"[offline] dpo_beta must be > 0, got {self.dpo_beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"[offline] label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.eval_freq < 1:
            raise ValueError(f"[offline] eval_freq must be >= 1, got {self.eval_freq}")


@dataclass
class JobConfig:
    """All sections of a titanrl job. Field names here are the TOML section names."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    parallelism: Parallelism = field(default_factory=Parallelism)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    generator: Generator = field(default_factory=Generator)
    algorithm: Algorithm = field(default_factory=Algorithm)
    reward: Reward = field(default_factory=Reward)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    critic: Critic = field(default_factory=Critic)
    env: Env = field(default_factory=Env)
    offline: Offline = field(default_factory=Offline)

    def validate(self) -> None:
        """Run every section's own checks, then the ones that span sections."""
        for section_name in self.__dataclass_fields__:
            section = getattr(self, section_name)
            if hasattr(section, "validate"):
                section.validate()
        multi_turn_tasks = ("calculator", "python", "guess_number")
        if self.data.task in multi_turn_tasks and not self.env.name:
            raise ValueError(f"[data] task '{self.data.task}' is multi-turn: set env.name = '{self.data.task}'")
        if self.env.name and self.reward.function:
            raise ValueError("[reward] function is not used with an [env]: the environment's steps give the rewards")
        if self.algorithm.name == "ppo" and not self.critic.enable:
            raise ValueError("[algorithm] 'ppo' needs a value model: add [critic] with enable = true")
        if self.critic.enable and self.algorithm.name != "ppo":
            raise ValueError(f"[critic] enable = true, but algorithm '{self.algorithm.name}' uses no critic; use 'ppo'")
        if self.model.max_seq_len and 0 < self.training.micro_batch_tokens < self.model.max_seq_len:
            raise ValueError(
                f"[training] micro_batch_tokens ({self.training.micro_batch_tokens}) is below one sequence "
                f"of model.max_seq_len ({self.model.max_seq_len}); raise it or set 0"
            )

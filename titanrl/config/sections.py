"""Sections of the job configuration shared by every recipe: the job, the model and its
placement, the optimizer, data, checkpoints and metrics. A docstring under every field; each
section checks its own fields in `validate()`."""

import difflib
from dataclasses import dataclass
from typing import Literal

BUILTIN_RECIPES = ("rl", "sft", "dpo", "reward_model")
"""The recipes that ship with titanrl (`titanrl/recipes/`), by `job.recipe` name."""


@dataclass
class Job:
    config_file: str = ""
    """TOML file with the job configuration; values given on the command line override it."""

    recipe: str = "rl"
    """What the job trains (one file each under `titanrl/recipes/`): 'rl' (GRPO family, PPO: see
    [algorithm]), 'sft' on worked solutions, 'dpo' and 'reward_model' (Bradley-Terry score head)
    on {prompt, chosen, rejected} pairs. Or a recipe forked out of the tree (`titanrl cp rl
    my_rl.py`): a `Recipe` subclass as 'package.module:Class', 'path/to/file.py:Class' or
    'path/to/file.py' (its one subclass); a relative path is looked up in the current directory,
    then beside the config file. Settings that need job.recipe = 'rl' ([[eval]] suites,
    [distillation], rollout.mode = 'one_step') need the built-in name."""

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
        if self.recipe not in BUILTIN_RECIPES and ":" not in self.recipe and not self.recipe.endswith(".py"):
            close = difflib.get_close_matches(self.recipe, BUILTIN_RECIPES, n=1, cutoff=0.6)
            raise ValueError(
                f"Invalid value {self.recipe!r} for 'job.recipe': expected one of "
                + ", ".join(repr(r) for r in BUILTIN_RECIPES)
                + ", or a Recipe subclass as 'package.module:Class' or 'path/to/file.py[:Class]'."
                + (f" Did you mean '{close[0]}'?" if close else "")
            )
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

    ep: int = 1
    """Expert-parallel degree of mixture-of-experts models: each group of `ep` dp_shard ranks holds
    1/ep of the experts and exchanges tokens with all-to-all; FSDP2 shards the experts further over
    dp_shard / ep (TorchTitan's layout, no extra ranks). Must divide dp_shard and the expert count."""

    cp: int = 1
    """Context-parallel degree of the trainer: each sequence (packed row) is split into 2 x cp
    chunks, every cp rank holding a head and a tail chunk (causal load balance), attention
    all-gathers keys and values over cp. The cp ranks of a group see the same batch and join the
    FSDP2 group (it shards over dp_shard x cp, TorchTitan's layout). The generator is not
    context-parallel (docs/context_parallel.md)."""

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"[parallelism] {name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"[parallelism] dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}")


@dataclass
class Training:
    steps: int = 100
    """Number of optimizer steps."""

    batch_size: int = 16
    """Global rows per step, split across dp ranks: prompts for 'rl' (each sampled
    algorithm.group_size times), demonstrations for 'sft', preference pairs for 'dpo' / 'reward_model'."""

    micro_batch_tokens: int = 0
    """Token budget of one forward/backward (gradient accumulation) in every recipe and the SFT
    warm-up: sequences are sorted by length and split into about
    padded tokens / budget micro-batches, as many on every dp rank (a preference pair stays in
    one); 0 = the whole mini-batch."""

    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; 0 disables clipping."""

    logprob_chunk_tokens: int = 256
    """Positions whose logits are computed at once for logprobs and entropy (forward, and again
    in backward); memory for logits is this x vocab floats instead of tokens x vocab. Large enough
    for the matrix product to run at full speed, small enough to keep the buffer small at a
    150k vocabulary (docs/benchmarks.md: bench_logprob_memory)."""

    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype of parameters in forward/backward (FSDP2's mixed precision, also on one rank; master
    weights and optimizer state stay float32). The generator holds its weights in this dtype, so
    sampler and trainer compute alike."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter under FSDP2."""

    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient norm: 'skip' drops that update (counted in metrics), 'stop' ends the run."""

    packing: Literal["auto", "on", "off"] = "auto"
    """RL recipe: run the model over packed rows (sequences concatenated, attention within each,
    positions restarting at 0; `titanrl/data/packing.py`) instead of right-padded ones, for the
    policy update, reference / old logprobs and critic. Same losses up to float rounding (bitwise
    in batch-invariant mode). 'auto' = on when the padded micro-batches would hold at least 1.15
    times the packed token slots (long-tailed lengths); 'off' = padded rows."""

    balance_tokens: bool = True
    """RL recipe, dp > 1: before the logprob passes and the update, whole groups move between dp
    ranks so that each computes about as many prompt + response tokens (largest group first, to
    the least-loaded rank; `titanrl/distributed/balance.py`). Every rank waits for the slowest at
    each collective, and with long-tailed responses the rank that generated a long group
    otherwise sets the step's time. Same losses up to float rounding; off: each rank trains what it generated.
    Only with algorithm.num_minibatches = 1: each rank splits its rows into mini-batches in
    order, so moving groups would change which samples share an optimizer step."""

    def validate(self) -> None:
        if self.logprob_chunk_tokens < 1:
            raise ValueError(f"[training] logprob_chunk_tokens must be >= 1, got {self.logprob_chunk_tokens}")
        for name in ("steps", "micro_batch_tokens"):
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
class Data:
    task: str = "arithmetic"
    """Embedded task name (e.g. 'arithmetic', 'reverse'); not used when `path` names a file."""

    path: str = ""
    """Your own data, read instead of an embedded task, by extension: a .jsonl file (one JSON object per line), a
    .parquet file, or a Hugging Face `datasets` folder written by save_to_disk (Parquet and Arrow
    need the 'data' extra); rows with a prompt and an answer (see prompt_key, answer_key)."""

    prompt_key: str = "prompt"
    """Column of the prompt: a string, or a list of {role, content} chat messages (kept in the
    sample's metadata 'messages'); a dotted path reads a nested field, e.g. 'extra_info.question'."""

    answer_key: str = "answer"
    """Column of the reference answer (string or number); with the default, a row without it uses
    verl's reward_model.ground_truth."""

    solution_key: str = "solution"
    """Column of a worked solution for SFT; rows without it use the answer."""

    chat_template: bool = False
    """Render every prompt with the chat template of model.tokenizer's folder (tokenizer_config.json
    or chat_template.jinja; needs the 'chat' extra): a text prompt as one user message, a
    messages prompt as it is, with the generation prompt; off: bos + the prompt text."""

    system_prompt: str = ""
    """With chat_template: a system message put first in every prompt that has none."""

    max_prompt_chars: int = 0
    """Longest prompt in characters (plain text, before any chat template) kept at load; 0 = no limit."""

    on_long_prompt: Literal["drop", "error"] = "drop"
    """A row over max_prompt_chars, or too long in tokens once encoded (RL: prompt +
    generator.max_new_tokens > model.max_seq_len; SFT / DPO / RM: the whole sequence), checked at
    start-up: 'drop' it (the count and the first rows' file:line are printed) or 'error' naming
    the file and line."""

    num_eval_samples: int = 64
    """Held-out prompts used by the periodic greedy evaluation (with `path`: the file's first
    rows, which are then not trained on)."""

    allow_changed: bool = False
    """Resume even if `path` is not the data the checkpoint was trained on. A checkpoint records
    each data file's path, size and a hash of the rows read; a resume on other rows stops with
    an error naming the file, unless this is true (then a notice is printed)."""

    def validate(self) -> None:
        if self.task == "jsonl":
            raise ValueError(
                "[data] task = 'jsonl' has moved: data.path alone selects file data (.jsonl, .parquet or a "
                "datasets folder); remove data.task"
            )
        if self.num_eval_samples < 0:
            raise ValueError(f"[data] num_eval_samples must be >= 0, got {self.num_eval_samples}")
        if self.system_prompt and not self.chat_template:
            raise ValueError("[data] system_prompt needs chat_template = true (plain prompts have no roles)")
        if self.max_prompt_chars < 0:
            raise ValueError(f"[data] max_prompt_chars must be >= 0 (0 = no limit), got {self.max_prompt_chars}")
        for name in ("prompt_key", "answer_key", "solution_key"):
            if not getattr(self, name).strip():
                raise ValueError(f"[data] {name} must name a column, got {getattr(self, name)!r}")


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

    async_mode: Literal["disabled", "async"] = "disabled"
    """'async' copies the state to host memory and writes it in a background thread while training
    goes on (`torch.distributed.checkpoint.async_save`, over its own gloo group); the step-N
    folder appears when the write has finished (a crash before then leaves the previous
    checkpoint as the latest), and a failed write is raised at the next save or at the end of
    the run. Costs one extra host copy of the model and optimizer state while a save is in flight."""

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
class Profiling:
    enable_profiling: bool = False
    """Trace steps with `torch.profiler` (CPU ops always, CUDA kernels on GPU) and write a Chrome
    trace per rank to <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json."""

    save_traces_folder: str = "profile_traces"
    """Folder of the profiler traces, relative to job.dump_folder."""

    profile_freq: int = 10
    """Trace the steps that end a cycle of this many: steps profile_freq, 2 x profile_freq ..."""

    profiler_warmup: int = 3
    """Steps the profiler runs without recording before the traced ones (its start-up cost stays
    out of the trace); profiler_warmup + profiler_active must be <= profile_freq."""

    profiler_active: int = 1
    """Steps recorded in each trace (the last ones of each profile_freq cycle)."""

    gzip_traces: bool = False
    """Write rank<r>_trace.json.gz (Perfetto and chrome://tracing open it); traces of real models
    are large."""

    enable_memory_snapshot: bool = False
    """At the traced steps, and when a step runs out of memory: on CUDA a pickled
    `torch.cuda.memory._snapshot()` per rank (allocation history recorded from the first step;
    open it at https://pytorch.org/memory_viz); on CPU the peak resident memory as JSON."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder of the memory snapshots, relative to job.dump_folder."""

    def validate(self) -> None:
        for name in ("profile_freq", "profiler_active"):
            if getattr(self, name) < 1:
                raise ValueError(f"[profiling] {name} must be >= 1, got {getattr(self, name)}")
        if self.profiler_warmup < 0:
            raise ValueError(f"[profiling] profiler_warmup must be >= 0, got {self.profiler_warmup}")
        if self.enable_profiling and self.profiler_warmup + self.profiler_active > self.profile_freq:
            raise ValueError(
                f"[profiling] profiler_warmup ({self.profiler_warmup}) + profiler_active ({self.profiler_active}) "
                f"must be <= profile_freq ({self.profile_freq}): lower them or raise profile_freq"
            )
        for name in ("save_traces_folder", "save_memory_snapshot_folder"):
            if not getattr(self, name).strip():
                raise ValueError(f"[profiling] {name} must name a folder, got {getattr(self, name)!r}")

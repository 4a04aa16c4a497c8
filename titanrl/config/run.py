"""The run itself: `[job]` (what it trains, seed, determinism), `[checkpoint]`, `[metrics]`
and `[profiling]` (what it writes). A docstring under every field; each section checks its own
fields in `validate()`."""

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

    dump_episodes: int = 4
    """RL: every log_freq steps rank 0 appends this many of the step's sampled episodes (tokens,
    generator logprobs, environment turns, reward, failure reason) to <dump_folder>/episodes.jsonl,
    which `titanrl show` renders as an HTML page (docs/viewer.md); 0 writes none."""

    def validate(self) -> None:
        if self.log_freq < 1:
            raise ValueError(f"[metrics] log_freq must be >= 1, got {self.log_freq}")
        if self.dump_episodes < 0:
            raise ValueError(f"[metrics] dump_episodes must be >= 0 (0 writes none), got {self.dump_episodes}")
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

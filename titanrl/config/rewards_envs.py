"""What scores a sample: `[reward]` (verifier and reward functions, a reward model, their
workers) and `[env]` (multi-turn environments: in-process, servers, verifiers). A docstring under
every field; each section checks its own fields in `validate()`."""

from dataclasses import dataclass, field


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


TOOL_FORMATS = ("tag", "hermes", "llama3", "auto")
"""The values of [env] tool_format (envs/tool_calls.py reads them; 'auto' picks from the template)."""


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

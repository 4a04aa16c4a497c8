"""`[agent]`: episodes played by your own agent program against an OpenAI-compatible endpoint that
each rank serves over its generator (docs/agents.md). A docstring under every field; the section
checks its own fields in `validate()`."""

from dataclasses import dataclass

from titanrl.config.rewards_envs import TOOL_FORMATS

ON_REWRITE = ("drop", "split")


@dataclass
class Agent:
    function: str = ""
    """Your agent as 'module:function' (or 'path/to/file.py:function'): an async function called
    as `await f(base_url=..., api_key=..., model=..., row=...)` once per episode (row: the task's
    {'prompt', 'answer', 'metadata'}), which calls the model through the OpenAI API at base_url and
    returns the episode's reward, or None to score the final transcript with [reward]'s function
    (or the task's verifier). Empty: no agent (single-turn tasks or an [env])."""

    num_workers: int = 2
    """Worker processes that run agent episodes (each runs many episodes concurrently on its own
    event loop), contained as reward workers are: whatever an agent starts dies with its worker."""

    timeout_s: float = 120.0
    """Seconds an episode may take from its start to its agent's return, model calls included;
    past it the episode fails ('timeout') and its agent is cancelled (its worker replaced if the
    agent does not let go)."""

    max_turns: int = 8
    """Most model calls per episode; the call after them is refused (HTTP 400, the sample ends)."""

    max_total_tokens: int = 1024
    """Most completion tokens (model and harness) per episode; generator.max_new_tokens is per call.
    A call that would cross it is refused (HTTP 400 'context_length_exceeded') and the sample ends."""

    model: str = "policy"
    """The model name the endpoint serves (`GET /v1/models`); a call naming another model fails
    its episode ('unknown_model')."""

    tool_format: str = "auto"
    """How the model writes tool calls, which the endpoint returns as OpenAI `tool_calls`: 'hermes',
    'llama3', or 'auto' (read from data.chat_template's template)."""

    on_rewrite: str = "drop"
    """What happens when a call's conversation is not the previous call's plus new messages (the
    harness rewrote history: dropped a thought, edited a turn): 'drop' fails the episode
    ('rewrite', counted) and refuses the call (HTTP 409), so that no sample trains on tokens the
    model did not see; 'split' ends the sample there and goes on in a new sample whose prompt is
    the call's conversation (the call waits for the next generation round), every sample of the
    episode trained with the episode's advantage (counted in 'agent_splits'; not with a critic)."""

    memory_limit_mb: int = 2048
    """Memory limit of each agent worker (address space; with a memory cgroup, its whole tree);
    0 means no limit."""

    def validate(self) -> None:
        if not self.function:
            return
        if ":" not in self.function:
            raise ValueError(f"[agent] function {self.function!r} must be 'package.module:function'")
        for name in ("num_workers", "max_turns", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"[agent] {name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"[agent] timeout_s must be > 0, got {self.timeout_s}")
        if self.on_rewrite not in ON_REWRITE:
            raise ValueError(f"[agent] on_rewrite must be one of {ON_REWRITE}, got {self.on_rewrite!r}")
        if self.tool_format not in TOOL_FORMATS or self.tool_format == "tag":
            raise ValueError(f"[agent] tool_format must be 'auto', 'hermes' or 'llama3', got {self.tool_format!r}")
        if not self.model or self.memory_limit_mb < 0:
            raise ValueError("[agent] model must be non-empty and memory_limit_mb >= 0")

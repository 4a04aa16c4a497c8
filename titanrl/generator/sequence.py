"""What the generator hands back (`Completion`, `GenerationStats`), the multi-turn hook
(`TurnHandler`), and the scheduler's per-sample state (`Seq`)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import torch

from titanrl.generator.sampling import SamplingParams
from titanrl.models.tokenizer import Tokenizer

FinishReason = Literal["stop", "length", "paused"]


def _completion_reason(reason: str | None) -> FinishReason:
    """A finished sample's reason without the multi-turn 'done:' mark."""
    assert reason is not None, "a finished sample has a finish reason"
    reason = reason.removeprefix("done:")
    assert reason in ("stop", "length", "paused"), reason
    return cast(FinishReason, reason)


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    """'paused': generation was paused (`pause_when`) before the sample finished; pass it back
    as a `ResumedSample` to continue it (a sample of a group never started has no tokens)."""
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    model_mask: list[int] | None = None
    """Multi-turn only: 1 for tokens the model sampled, 0 for environment tokens (logprob 0)."""
    key: int = 0
    """Key of the sample's random stream: a resumed sample continues the same stream."""
    versions: list[int] | None = None
    """Streams (`Generator.stream`): the weight version that sampled each token (its logits);
    None for `generate`, whose tokens all come from the weights it was called with."""
    routes: torch.Tensor | None = None
    """MoE models: the experts each MoE layer chose for every token the generator fed to the
    model, prompt and completion, [prompt + completion tokens - 1, MoE layers, top_k] int16
    (the last token is sampled, never fed); -1 where none was recorded. None for dense models."""


@dataclass
class ResumedSample:
    """A paused sample to continue: `Completion` fields of a 'paused' completion. Its prompt
    (`prompts[prompt_index]` of the `generate` call) is not forked into a new group; the sample
    is prefilled again (prompt blocks shared with its group's other resumed samples) and
    continues its random stream, under whatever weights the generator has now."""

    prompt_index: int
    sample_index: int
    key: int
    token_ids: list[int]
    """Completion tokens so far (at least one)."""
    logprobs: list[float]

    def validate(self, prompt_len: int, max_seq_len: int) -> None:
        if not self.token_ids or len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"resumed sample {(self.prompt_index, self.sample_index)} needs its tokens and their logprobs"
            )
        if prompt_len + len(self.token_ids) >= max_seq_len:
            raise ValueError(f"resumed sample {(self.prompt_index, self.sample_index)} already fills the model context")


PauseWhen = Callable[[list[tuple[int, int]], "GenerationStats"], bool]
"""Asked after every scheduler pass with the (prompt, sample) keys finished so far in this call
and the call's stats; True pauses every unfinished sample (KV blocks freed) and returns."""


class TurnHandler(Protocol):
    """Drives multi-turn generation (see `titanrl/envs/multi_turn.py`). A sample that stops
    (eos, stop string, length) is handed to `submit` and keeps its KV blocks while its
    environment step runs; the other samples keep decoding. `poll` returns the steps that are
    done: (key, observation token ids) resumes the sample after appending them, (key, None)
    ends it. `key` is (prompt_index, sample_index)."""

    def submit(self, key: tuple[int, int], turn_token_ids: list[int], finish_reason: str) -> None: ...

    def poll(self, block: bool) -> list[tuple[tuple[int, int], list[int] | None]]: ...


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    """Tokens whose KV was computed in prefill (prompts once per group, plus recomputation)."""
    prefix_cache_hit_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    paused: int = 0
    """Samples returned unfinished because `pause_when` said so."""
    resumed_turns: int = 0
    """Multi-turn: turns resumed after an environment step, with their KV blocks kept."""
    steps: int = 0
    """Forward steps (prefill or one decode token per running sample)."""
    decode_steps: int = 0
    """Decode forward steps (each one token for every sample of its batch). On an accelerator a
    decode step costs about the same at any batch size: decode_steps, not decode_tokens, is
    what the long tail costs there."""
    scheduler_passes: int = 0
    """Host scheduling passes; a pass runs up to generator.decode_steps_per_schedule decode steps."""
    seconds: float = 0.0
    compile_seconds: float = 0.0
    """Of `seconds`, spent compiling (a new batch bucket or prefill shape; cache hits trace only)."""
    prefill_chunks: int = 0
    """Chunked prefill: prefill forwards that left part of a sequence's context for a later step."""

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Seq:
    """One sample being generated (or, before prefill, a group's prompt), with its block table."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    key: int
    """Key of the sample's random stream (`sampling.counter_uniform`)."""
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefill_end: int = 0
    """Where the current prefill step's chunk of the context ends (`Scheduler.admit`)."""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    # A group's prompt before its samples are forked off; it samples n first tokens.
    is_group_prompt: bool = False
    # Multi-turn: where the current model turn began, and 1/0 per completion token (sampled by
    # the model / appended by the environment).
    turn_start: int = 0
    model_mask: list[int] = field(default_factory=list)
    # MoE route recording: (first position, experts [n, MoE layers, top_k]) per forward that fed
    # positions first .. first + n - 1; a recomputed position's later chunk wins.
    route_chunks: list[tuple[int, torch.Tensor]] | None = None
    # Hybrid models: the slot of the linear layers' recurrent state (`state_slots.py`); -1: none.
    state_slot: int = -1
    # Sliding-window layers (gpt-oss): their block table over the window pool (`window_pages.py`).
    window_table: list[int] = field(default_factory=list)
    # Streams: the weight version of each completion token (`Scheduler.stamp_versions`).
    versions: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """Tokens of the current turn (the whole completion when single-turn)."""
        return len(self.token_ids) - max(self.prompt_len, self.turn_start)

    @property
    def turn_token_ids(self) -> list[int]:
        """Tokens of the current turn: what a stop string is searched in, what an environment reads."""
        return self.token_ids[max(self.prompt_len, self.turn_start) :]

    @property
    def context_end(self) -> int:
        """Tokens whose K/V must be computed before the next sampling step: all of a group
        prompt (its last row samples the first tokens), all but the last otherwise (the last,
        already sampled, is fed in by the next step)."""
        return len(self.token_ids) - (0 if self.is_group_prompt else 1)

    def append_observation(self, obs: list[int]) -> None:
        """Multi-turn: append an environment's tokens (logprob 0, mask 0); a new model turn starts."""
        # Tokens since the last observation were sampled by the model.
        self.model_mask.extend([1] * (len(self.token_ids) - self.prompt_len - len(self.model_mask)))
        self.token_ids.extend(obs)
        self.logprobs.extend([0.0] * len(obs))
        self.model_mask.extend([0] * len(obs))
        self.turn_start = len(self.token_ids)
        self.finish_reason = None

    def to_completion(self, tokenizer: Tokenizer | None) -> Completion:
        ids = self.token_ids[self.prompt_len :]
        return Completion(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=ids,
            logprobs=self.logprobs,
            finish_reason=_completion_reason(self.finish_reason),
            text=tokenizer.decode(ids) if tokenizer is not None else None,
            top_logprobs=self.top_logprobs if self.params.num_top_logprobs else None,
            model_mask=(self.model_mask + [1] * (len(ids) - len(self.model_mask))) if self.model_mask else None,
            key=self.key,
            versions=list(self.versions) if self.versions else None,
            routes=self.assemble_routes(),
        )

    def assemble_routes(self) -> torch.Tensor | None:
        """The recorded routes of the fed positions 0 .. len(token_ids) - 2 (`Completion.routes`)."""
        return None if self.route_chunks is None else self.routes_of_first(len(self.token_ids) - 1)

    def routes_of_first(self, n: int) -> torch.Tensor:
        """The routes recorded for positions 0 .. n - 1, [n, MoE layers, top_k] int16: later chunks
        win, -1 where none was recorded."""
        chunks = self.route_chunks or []
        L, K = chunks[0][1].shape[1:] if chunks else (0, 0)
        routes_PLK = torch.full((n, L, K), -1, dtype=torch.int16)
        for start, chunk_NLK in chunks:
            m = max(0, min(len(chunk_NLK), n - start))
            routes_PLK[start : start + m] = chunk_NLK[:m]
        return routes_PLK

"""Multi-turn rollouts: episodes of an environment driven by the paged generator.

`MultiTurnRollout` is the generator's `TurnHandler`: when a sample's turn ends, its text goes to
its environment (in a worker process) while the other samples keep decoding; the observation
comes back as tokens that the generator appends to the sample, prefilling only them (the earlier
turns' K/V stay in the sample's blocks). An episode ends when the environment says done, after
`max_turns` model turns, past `max_total_tokens`, or when its environment fails (raises, hangs,
returns garbage): that episode gets the failure reward and a recorded reason, the rest go on.

Without a chat template an observation is its raw tokens (`tokenizer.encode(observation)`). With
one (a `PromptEncoder` that has a template, `data.chat_template = true`) the turns are rendered
as the template renders the conversation: the appended tokens are the text the template writes
between the assistant's turn and the next one, i.e. the end of the assistant's turn (ChatML's
`<|im_end|>\\n`), the observation as a message of `observation_role` ('user', or 'tool' for tool
results) and the generation prompt (`<|im_start|>assistant\\n`). That text is a delta of two
renderings, as `ChatTemplate.assistant_mask` takes its spans: the conversation so far with the
generation prompt, and the conversation with the assistant's turn and the observation appended,
with the generation prompt; the assistant's turn is rendered as a placeholder, since its tokens
are already in the sample (the delta is the same for any content the template writes verbatim,
and the sample keeps what the model really saw when a template would rewrite it). Of the delta,
what the model already wrote is dropped: the special token that ended its turn (e.g. the eos
`<|im_end|>`) when the delta starts with it, or with another end-of-turn token (Llama 3.1 ends a
tool call with `<|eom_id|>` where the delta writes `<|eot_id|>`: the model's token stays, the
template's is dropped); a turn that ended on max tokens or a stop string gets the whole
end-of-turn text. Templates that render the earlier conversation differently once
a turn is added (so that no delta exists) are rejected with an error. The appended tokens are
the environment's: the generator's model mask keeps them (the template's text included) out of
the loss.

Tool calls (`titanrl/envs/tool_calls.py`): the environment's tools (`Environment.tools`) are passed
to the template when the prompt is rendered (HF's `tools`), and the results of several calls in one
turn (a step's `info['tool_results']`) are rendered as one 'tool' message each, which templates
such as Qwen's group into one turn. The model's turn reaches the environment as the decoding of its
generated tokens, with the special tokens a tool format reads kept as text (Llama 3's
`<|python_tag|>`, which marks a call after prose); the sample keeps those tokens as generated
(token in, token out): no text is ever encoded back into the model's part of the sequence.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from titanrl.data.encode import PromptEncoder
from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.base import StepResult
from titanrl.envs.pool import EnvPool, resolve_env
from titanrl.envs.tool_calls import PYTHON_TAG, resolve_tool_format
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import Tokenizer

OBSERVATION_ROLES = ("user", "tool")
# Stands for an assistant turn's content in renderings: only the text around it is encoded.
_ASSISTANT_PLACEHOLDER = "TITANRL_ASSISTANT_TURN"

Key = tuple[int, int]


@dataclass
class Episode:
    sample: dict
    rewards: list[float] = field(default_factory=list)
    """Reward of each environment step (per-turn rewards and the final one)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    """Turns whose tool calls were malformed (answered with an error observation)."""
    correct: bool = False
    failed: str | None = None
    done: bool = False

    @property
    def reward(self) -> float:
        return sum(self.rewards)


def special_token_ids(tokenizer: Tokenizer, texts: tuple[str, ...]) -> dict[int, str]:
    """{id: text} of each of `texts` that is one special token of `tokenizer` (one id that decodes
    to no text); texts that are not are left out (a tokenizer without `<|python_tag|>`)."""
    out = {}
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) == 1 and not tokenizer.decode(ids):
            out[ids[0]] = text
    return out


def decode_turn(tokenizer: Tokenizer, ids: list[int], keep: dict[int, str]) -> str:
    """`tokenizer.decode(ids)` with the special tokens of `keep` written as their text."""
    if not keep or not any(i in keep for i in ids):
        return tokenizer.decode(ids)
    parts, start = [], 0
    for pos, token in enumerate(ids):
        if token in keep:
            parts += [tokenizer.decode(ids[start:pos]), keep[token]]
            start = pos + 1
    return "".join(parts) + tokenizer.decode(ids[start:])


class ChatTurns:
    """Per-episode conversation state that renders environment turns through a chat template
    (see the module docstring)."""

    def __init__(
        self,
        encoder: PromptEncoder,
        role: str,
        tools: list[dict] | None = None,
        end_of_turn_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`end_of_turn_ids`: the tokens that end a model's turn (the generator's eos ids; the
        tokenizer's eos is always one)."""
        if encoder.template is None:
            raise ValueError("ChatTurns needs a PromptEncoder with a chat template")
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"observation role must be one of {OBSERVATION_ROLES}, got {role!r}")
        self.encoder, self.template, self.role, self.tools = encoder, encoder.template, role, tools
        eos = encoder.tokenizer.eos_id
        self.end_of_turn_ids = frozenset(end_of_turn_ids) | ({eos} if eos is not None else set())
        self.messages: dict[Key, list[dict]] = {}
        self.rendered: dict[Key, str] = {}
        """The conversation of each episode so far, as text, ending with the generation prompt."""
        self.tools_of: dict[Key, list[dict] | None] = {}

    def start(self, keys: list[Key], prompt: str, tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids (as `PromptEncoder` gives them); `keys` (a group) share it.
        `tools`: the episodes' own (a verifiers harness's), instead of the environment's."""
        messages = self.encoder.messages(prompt)
        tools = tools if tools is not None else self.tools
        text = self.template.render(messages, add_generation_prompt=True, tools=tools)
        for key in keys:
            self.messages[key], self.rendered[key], self.tools_of[key] = messages, text, tools
        return self.encoder.tokenizer.encode(text)

    def observation(
        self, key: Key, observation: str, last_token: int | None, tool_results: list[str] | None = None
    ) -> list[int]:
        """Token ids that end the assistant's turn (less the special token `last_token` it ended
        on, if the template writes it there), carry `observation` as a `role` message (or, as
        'tool' messages, each of `tool_results`) and open the next assistant turn."""
        if self.role == "tool" and tool_results:
            said = [{"role": "tool", "content": result} for result in tool_results]
        else:
            said = [{"role": self.role, "content": observation}]
        messages = self.messages[key] + [{"role": "assistant", "content": _ASSISTANT_PLACEHOLDER}, *said]
        before = self.rendered[key] + _ASSISTANT_PLACEHOLDER
        after = self.template.render(messages, add_generation_prompt=True, tools=self.tools_of[key])
        if not after.startswith(before):
            raise ValueError(
                f"multi-turn environment: the chat template of {self.template.source} does not render the "
                f"conversation consistently when a turn is added (message {len(messages) - 2}): the conversation "
                "with the generation prompt, then the assistant's turn, is not a prefix of the conversation with "
                f"the assistant's turn and '{self.role}' observations (does the template rewrite earlier turns, or "
                "write more than the generation prompt before an assistant message?)"
            )
        self.messages[key], self.rendered[key] = messages, after
        tokenizer = self.encoder.tokenizer
        return drop_turn_end(tokenizer, tokenizer.encode(after[len(before) :]), last_token, self.end_of_turn_ids)


def drop_turn_end(tokenizer: Tokenizer, ids: list[int], last_token: int | None, ends: frozenset[int]) -> list[int]:
    """`ids` (the text a template writes after an assistant turn, encoded) less its first token
    when that is the special token `last_token` that ended the turn, already in the sample (a
    special token has no text of its own), or another end-of-turn token of `ends` it stands for."""
    if ids and last_token is not None and not tokenizer.decode([last_token]):
        if ids[0] == last_token or (last_token in ends and ids[0] in ends):
            return ids[1:]
    return ids


class MultiTurnRollout:
    def __init__(
        self,
        pool: EnvPool | AsyncEnvPool,
        tokenizer: Tokenizer,
        max_turns: int,
        max_total_tokens: int,
        failure_reward: float = 0.0,
        *,
        prompt_encoder: PromptEncoder | None = None,
        observation_role: str = "user",
        tools: list[dict] | None = None,
        keep_tokens: tuple[str, ...] = (),
        end_of_turn_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`prompt_encoder`: encodes the first observation (default for `start`); when it has a
        chat template, every turn is rendered through it, observations as `observation_role`
        messages, the prompt with `tools` (JSON schemas, `ToolSetup.tools`). `keep_tokens`: special
        tokens the environment reads, kept as text in a turn's decoding (`ToolSetup.keep_tokens`);
        `end_of_turn_ids`: the generator's eos ids."""
        self.pool, self.tokenizer = pool, tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.failure_reward = failure_reward
        self.prompt_encoder = prompt_encoder
        self.chat: ChatTurns | None = None
        if prompt_encoder is not None and prompt_encoder.template is not None:
            self.chat = ChatTurns(prompt_encoder, observation_role, tools, end_of_turn_ids)
        self.keep = special_token_ids(tokenizer, keep_tokens)
        self.episodes: dict[Key, Episode] = {}
        self._ids: dict[Key, int] = {}
        self._keys: dict[int, Key] = {}
        self._lengths: dict[Key, int] = {}
        self._last_token: dict[Key, int | None] = {}
        self._ended: list[tuple[Key, list[int] | None]] = []

    def start(
        self, samples: list[dict], group_size: int, encode_prompt: Callable[[str], list[int]] | None = None
    ) -> list[list[int]]:
        """Reset one environment per (prompt, sample) and return the prompts' token ids (the first
        observation; a group's G environments must agree on it, as they share its KV blocks).
        `encode_prompt` (default: the prompt encoder) is used without a chat template."""
        encode = encode_prompt if encode_prompt is not None else self.prompt_encoder
        assert encode is not None or self.chat is not None, "start() needs encode_prompt or a prompt_encoder"
        for i, sample in enumerate(samples):
            for j in range(group_size):
                key = (i, j)
                eid = len(self._ids)
                self._ids[key], self._keys[eid] = eid, key
                self.episodes[key] = Episode(sample)
                self.pool.reset(eid, sample)
        first: dict[Key, str | None] = {}
        while len(first) < len(self._ids):
            for r in self.pool.poll(block=True):
                key = self._keys[r.episode]
                assert r.value is None or isinstance(r.value, str), "a reset's result is its first observation"
                first[key] = r.value
                if r.error is not None:
                    self._fail(key, r.error)
        prompts = []
        for i in range(len(samples)):
            texts = {obs for j in range(group_size) if (obs := first[(i, j)]) is not None}
            if len(texts) > 1:
                raise ValueError(
                    f"the environment's first observation differs between the {group_size} samples of prompt "
                    f"{i}; reset() must depend only on the sample (seed any randomness from it)"
                )
            text = texts.pop() if texts else samples[i]["prompt"]
            keys = [(i, j) for j in range(group_size)]
            tools = self._episode_tools(keys)
            if self.chat is not None:
                prompts.append(self.chat.start(keys, text, tools))
            else:
                assert encode is not None
                prompts.append(encode(text))
            for key in keys:
                self._lengths[key] = 0  # completion tokens (model + environment) so far
        return prompts

    def _episode_tools(self, keys: list[Key]) -> list[dict] | None:
        """The tools a group's episodes declared (a verifiers harness's), else None."""
        found = [self.pool.episode_tools(self._ids[key]) for key in keys if not self.episodes[key].failed]
        if any(tools != found[0] for tools in found):
            raise ValueError(
                "the environment's tools differ between the samples of one prompt; they must depend only on the sample"
            )
        return found[0] if found else None

    def _fail(self, key: Key, reason: str) -> None:
        episode = self.episodes[key]
        episode.failed, episode.done = reason, True
        episode.rewards = [self.failure_reward]

    def _observation_tokens(self, key: Key, observation: str, tool_results: list[str] | None) -> list[int]:
        """The tokens appended for an observation: raw, or rendered through the chat template."""
        if self.chat is None:
            return self.tokenizer.encode(observation)
        return self.chat.observation(key, observation, self._last_token[key], tool_results)

    # ---- TurnHandler ----

    def submit(self, key: Key, turn_token_ids: list[int], finish_reason: str) -> None:
        episode = self.episodes[key]
        episode.turns += 1
        self._lengths[key] += len(turn_token_ids)
        self._last_token[key] = turn_token_ids[-1] if turn_token_ids else None
        if episode.done:  # its environment already failed (at reset)
            self._ended.append((key, None))
            return
        self.pool.step(self._ids[key], decode_turn(self.tokenizer, turn_token_ids, self.keep))

    def poll(self, block: bool) -> list[tuple[Key, list[int] | None]]:
        out, self._ended = self._ended, []
        if out:
            block = False
        for r in self.pool.poll(block):
            key = self._keys[r.episode]
            episode = self.episodes[key]
            if r.error is not None:
                self._fail(key, r.error)
                out.append((key, None))
                continue
            step = r.value
            assert isinstance(step, StepResult), "a step's result is a validated StepResult"
            results = step.info.get("tool_results")
            if results is not None and not (isinstance(results, list) and all(isinstance(x, str) for x in results)):
                self._fail(key, "invalid: info['tool_results'] must be a list of str")
                self.pool.close_episode(r.episode)
                out.append((key, None))
                continue
            episode.rewards.append(step.reward)
            episode.correct = episode.correct or bool(step.info.get("correct", False))
            episode.tool_calls += int(bool(step.info.get("tool_call", False)))
            episode.tool_errors += int(bool(step.info.get("tool_error", False)))
            obs = self._observation_tokens(key, step.observation, results) if step.observation else []
            over = episode.turns >= self.max_turns or self._lengths[key] + len(obs) > self.max_total_tokens
            if step.done or over or not obs:
                episode.done = True
                self.pool.close_episode(r.episode)
                out.append((key, None))
                continue
            self._lengths[key] += len(obs)
            out.append((key, obs))
        return out


@dataclass
class ToolSetup:
    """How an environment's episodes read and show tool calls (from env.tool_format)."""

    tool_format: str
    """'tag', 'hermes' or 'llama3' ('auto' resolved from the chat template)."""
    env_kwargs: dict
    """Constructor arguments of the environment: {'tool_format': ...} unless it is 'tag'."""
    tools: list[dict] | None
    """JSON schemas passed to the chat template (None with the 'tag' format)."""
    stop_strings: list[str]
    """The env's stop strings with the 'tag' format; none otherwise (the turn ends at its end of turn)."""
    keep_tokens: tuple[str, ...] = ()
    """Special tokens the format reads, kept as text when a turn is decoded (llama3: `<|python_tag|>`)."""


def tool_setup(env_name: str, tool_format: str, template: ChatTemplate | None) -> ToolSetup:
    """The `ToolSetup` of env `env_name` (a built-in name or 'module:Class') for `tool_format`;
    a format the environment does not read is a ValueError naming env.tool_format."""
    cls = resolve_env(env_name)
    fmt = resolve_tool_format(tool_format, list(template.templates.values()) if template is not None else None)
    if fmt == "tag":
        return ToolSetup(fmt, {}, None, list(getattr(cls, "stop_strings", ())))
    formats = tuple(getattr(cls, "tool_formats", ("tag",)))
    if fmt not in formats:
        raise ValueError(
            f"[env] tool_format {fmt!r}: the environment {env_name!r} reads only {formats} (its class attribute "
            "tool_formats); set env.tool_format to one of those or extend the environment"
        )
    tools = [dict(t) for t in getattr(cls, "tools", ())] or None
    return ToolSetup(fmt, {"tool_format": fmt}, tools, [], (PYTHON_TAG,) if fmt == "llama3" else ())

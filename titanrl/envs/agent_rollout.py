"""Agent episodes as the generator's multi-turn samples: the `TurnHandler` over an `AgentPool`.

Every model call of an episode's agent is its sample's next turn, with exact tokens:

- the first call's conversation (chat: its messages and tools, rendered by the chat template with
  the generation prompt; completions: its prompt text, or token ids) is the prompt, shared by the
  group's G episodes (an episode whose first call differs from its group's fails);
- the model's turn is the generator's tokens, returned decoded, with tool calls in the template's
  format (`tool_calls.py`) as OpenAI `tool_calls` and, if asked, the generator's logprobs;
- a later call must extend the previous one: its assistant messages past those of the first call
  are the model's turns as returned (same tool-call ids, or same text), each rendered as a
  placeholder since its tokens are already in the sample (`multi_turn.py`'s delta of two
  renderings), and the text the template writes before the placeholder must be what it wrote
  before. The rest of the rendering, encoded, is the harness's tokens: appended to the sample and
  masked out of the loss. The model's text is never encoded back into the sample.

A call that does not extend the previous one (the harness rewrote history) fails the episode
('rewrite: ...', [agent] on_rewrite = 'drop') and is refused with HTTP 409; with 'split', the
sample ends there and the episode goes on in a new sample whose prompt is that call's
conversation (rendered as a first call is), generated in a later round (`next_round`): the
call waits for it. A call past
[agent] max_turns or max_total_tokens ends the sample (400 'context_length_exceeded'); the
agent's return is still its reward ('length' if it raises). An agent that returns None has its
final transcript scored by [reward] (`Episode.score_transcript`).
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from titanrl.envs.agent_pool import AgentEvent, AgentPool
from titanrl.envs.multi_turn import Episode, Key, decode_turn, drop_turn_end, special_token_ids
from titanrl.envs.openai_endpoint import EndpointError, Request, reply
from titanrl.envs.tool_calls import HERMES_OPEN, PYTHON_TAG, ToolCall, ToolCallError, parse_tool_calls, tool_name
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import Tokenizer

_PLACEHOLDER = "TITANRL_ASSISTANT_TURN"


class Rewrite(Exception):
    """A call whose conversation is not the previous call's plus new messages."""


@dataclass
class AgentEpisode(Episode):
    score_transcript: bool = False
    """The agent returned None: [reward] scores the sample's transcript."""
    truncated: bool = False
    """A call past max_turns / max_total_tokens ended the sample."""
    splits: int = 0
    """Samples the episode started over after its harness rewrote history ([agent] on_rewrite = 'split')."""


@dataclass
class _Conversation:
    """One episode's calls so far, as the sample holds them."""

    route: str
    rendered: str = ""
    """chat: the last rendering (assistant turns as placeholders), ending with the generation prompt."""
    fixed: int = 0
    """chat: assistant messages of the first call (the harness's own, rendered as text)."""
    tools: list[dict] | None = None
    replies: list[tuple[str, list[str]]] = field(default_factory=list)
    """chat: each model turn as returned: (content, tool-call ids)."""
    ids: list[int] = field(default_factory=list)
    """completions: prompt and completion tokens so far."""
    text: str = ""
    """completions with a text prompt: the prompt and the turns' text so far."""
    request: Request | None = None


def _content(text: str, calls: list[ToolCall], tool_format: str) -> str | None:
    """A turn's prose, without its tool calls (None if there is none)."""
    if not calls:
        return text
    cut = text.find(HERMES_OPEN if tool_format == "hermes" else PYTHON_TAG)
    prose = text[:cut] if cut >= 0 else ("" if tool_format == "llama3" else text)
    return prose.strip() or None


def _first_completion(tokenizer: Tokenizer, conv: _Conversation, request: Request) -> list[int]:
    """The prompt ids of an episode's first text completion (its text encoded, or its ids)."""
    if isinstance(request.prompt, str):
        conv.text, conv.ids = request.prompt, tokenizer.encode(request.prompt)
    else:
        if any(not 0 <= t < tokenizer.vocab_size for t in request.prompt):
            raise EndpointError(400, "prompt token ids outside the vocabulary", reason="invalid: token ids")
        conv.ids = list(request.prompt)
    if not conv.ids:
        raise EndpointError(400, "the prompt has no tokens", reason="invalid: empty prompt")
    return list(conv.ids)


def _render(template: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> str:
    """The conversation rendered with the generation prompt; a template that fails on it refuses the call."""
    try:
        return template.render(messages, add_generation_prompt=True, tools=tools)
    except ValueError as e:
        raise EndpointError(400, str(e), reason=f"invalid: {e}"[:500]) from None


def _conversation(
    tokenizer: Tokenizer, template: ChatTemplate | None, request: Request
) -> tuple[_Conversation, list[int]]:
    """The conversation that starts at `request`, and its prompt ids."""
    conv = _Conversation(request.route, request=request)
    if request.route == "completions":
        return conv, _first_completion(tokenizer, conv, request)
    if template is None:
        raise EndpointError(400, "chat completions need data.chat_template = true", reason="invalid: no chat template")
    conv.rendered = _render(template, request.messages, request.tools)
    conv.tools, conv.fixed = request.tools, sum(m["role"] == "assistant" for m in request.messages)
    return conv, tokenizer.encode(conv.rendered)


def _generator_keys(
    rounds: dict[Key, Key], out: list[tuple[Key, list[int] | None]]
) -> list[tuple[Key, list[int] | None]]:
    """`out` by the generator's keys of this round's samples (episodes outside it have none)."""
    if not rounds:
        return out
    mine = {episode: key for key, episode in rounds.items()}
    return [(mine[key], obs) for key, obs in out if key in mine]


def _extend(
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    conv: _Conversation,
    request: Request,
    last_token: int | None,
    end_of_turn_ids: frozenset[int],
) -> list[int]:
    """The harness's tokens of a later call (the template's turn end after the model's last
    token, `last_token`, left out when the model wrote it); Rewrite if it does not extend `conv`."""
    if request.route != conv.route:
        raise Rewrite(f"the episode called {conv.route!r} first, now {request.route!r}")
    if request.route == "completions":
        return _extend_completion(tokenizer, conv, request)
    assert template is not None, "a chat episode started with a template"
    mine = [i for i, m in enumerate(request.messages) if m["role"] == "assistant"][conv.fixed :]
    if len(mine) != len(conv.replies):
        raise Rewrite(f"{len(mine)} assistant turns after the first call's, the episode has {len(conv.replies)}")
    messages = list(request.messages)
    for k, (i, (content, call_ids)) in enumerate(zip(mine, conv.replies)):
        said = messages[i]
        got = [c["id"] for c in said.get("tool_calls", [])]
        if got != call_ids or (not call_ids and said["content"].strip() != content.strip()):
            raise Rewrite(f"model turn {k + 1} is not what the model said")
        messages[i] = {"role": "assistant", "content": _PLACEHOLDER}
    before = conv.rendered + _PLACEHOLDER
    after = _render(template, messages, request.tools)
    if request.tools != conv.tools or not after.startswith(before):
        raise Rewrite("the conversation before the model's last turn renders differently")
    conv.rendered = after
    ids = tokenizer.encode(after[len(before) :])
    return drop_turn_end(tokenizer, ids, last_token, end_of_turn_ids)


def _extend_completion(tokenizer: Tokenizer, conv: _Conversation, request: Request) -> list[int]:
    if isinstance(request.prompt, list):
        if request.prompt[: len(conv.ids)] != conv.ids:
            raise Rewrite("the prompt's token ids do not start with the episode's")
        obs = request.prompt[len(conv.ids) :]
    else:
        if not conv.text or not request.prompt.startswith(conv.text):
            raise Rewrite("the prompt does not start with the episode's text")
        obs = tokenizer.encode(request.prompt[len(conv.text) :])
        conv.text = request.prompt
    conv.ids += obs
    return obs


class AgentRollout:
    def __init__(
        self,
        pool: AgentPool,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        tool_format: str,
        max_turns: int,
        max_total_tokens: int,
        failure_reward: float = 0.0,
        end_of_turn_ids: frozenset[int] = frozenset(),
        on_rewrite: str = "drop",
    ) -> None:
        self.pool, self.tokenizer, self.template, self.tool_format = pool, tokenizer, template, tool_format
        self.max_turns, self.max_total_tokens, self.failure_reward = max_turns, max_total_tokens, failure_reward
        eos = tokenizer.eos_id
        self.end_of_turn_ids = frozenset(end_of_turn_ids) | ({eos} if eos is not None else set())
        self.keep = special_token_ids(tokenizer, (PYTHON_TAG,) if tool_format == "llama3" else ())
        self.on_rewrite = on_rewrite
        self.max_prompt_len = 0
        """The longest prompt a split sample may start with (0: no limit); longer: the sample ends."""
        self.episodes: dict[Key, AgentEpisode] = {}
        self.splits: dict[Key, list[int]] = {}
        """Episodes whose harness rewrote history in this round: the prompt of their next sample."""
        self._round: dict[Key, Key] = {}
        """After the first round: the generator's key of each sample -> its episode's key."""
        self._ids: dict[Key, int] = {}
        self._keys: dict[int, Key] = {}
        self._conv: dict[Key, _Conversation] = {}
        self._lengths: dict[Key, int] = {}
        """Completion tokens (model and harness) so far."""
        self._prompt_lens: dict[Key, int] = {}
        self._last_token: dict[Key, int | None] = {}
        self._logprobs: dict[Key, list[float]] = {}
        self._ended: list[tuple[Key, list[int] | None]] = []
        self._closing: set[Key] = set()
        """Samples that are over whose agent has not returned yet (its last call refused)."""
        self._pending = 0
        """Calls submitted to the pool whose event has not come back."""

    # ---- the first call ----

    def start(self, samples: list[dict], group_size: int) -> list[list[int]]:
        """Start one agent episode per (prompt, sample) and return the prompts' token ids: each
        group's first call (see the module docstring)."""
        for i, sample in enumerate(samples):
            for j in range(group_size):
                eid = next(self.pool.episode_ids)
                self._ids[(i, j)], self._keys[eid] = eid, (i, j)
                self.episodes[(i, j)] = AgentEpisode(sample)
                self._lengths[(i, j)] = 0
                self.pool.reset(eid, sample)
                self._pending += 1
        first: dict[Key, list[int] | None] = {}
        while len(first) < len(self.episodes):
            for event in self._events(block=True):
                key = self._keys[event.episode]
                if event.kind == "request":
                    first[key] = self._open(key, event.value)
                    continue
                reason = event.error if event.kind == "fail" else "invalid: the agent returned before calling the model"
                self._fail(key, reason or "error")
                first[key] = None
        prompts = []
        for i, sample in enumerate(samples):
            found = [(j, ids) for j in range(group_size) if (ids := first[(i, j)]) is not None]
            prompt = found[0][1] if found else self.tokenizer.encode(sample["prompt"]) or [self.tokenizer.eos_id]
            for j, ids in found[1:]:
                if ids != prompt:
                    reason = "invalid: the agent's first call differs between the samples of one prompt"
                    self._end((i, j), reason, EndpointError(409, reason))
            for j in range(group_size):
                self._prompt_lens[(i, j)] = len(prompt)
            prompts.append(prompt)
        return prompts

    def _open(self, key: Key, request: Request) -> list[int] | None:
        """The prompt ids of a sample that starts at `request` (the episode's first call, or a
        call that rewrote history with on_rewrite = 'split'), or None: the call is refused and
        the episode fails."""
        try:
            self._conv[key], prompt = _conversation(self.tokenizer, self.template, request)
        except EndpointError as e:
            self._end(key, e.reason or "invalid: " + e.message, e)
            return None
        return prompt

    # ---- TurnHandler ----

    def record_logprobs(self, key: Key, logprobs: list[float]) -> None:
        """The generator's logprobs of the turn `submit` gets next (`TurnExchange.hand_over`)."""
        self._logprobs[self._round.get(key, key)] = logprobs

    def submit(self, key: Key, turn_token_ids: list[int], finish_reason: str) -> None:
        key = self._round.get(key, key)
        episode = self.episodes[key]
        episode.turns += 1
        self._lengths[key] += len(turn_token_ids)
        self._last_token[key] = turn_token_ids[-1] if turn_token_ids else None
        logprobs = self._logprobs.pop(key, None)
        if episode.done:
            self._ended.append((key, None))
            return
        conv = self._conv[key]
        assert conv.request is not None, "a turn answers the episode's pending call"
        request, conv.request = conv.request, None
        text = decode_turn(self.tokenizer, turn_token_ids, self.keep)
        calls: list[ToolCall] = []
        if request.route == "chat" and request.tools and request.parse_tools:
            try:
                calls = parse_tool_calls(text, self.tool_format, [tool_name(t) for t in request.tools])
            except ToolCallError:
                episode.tool_errors += 1  # a malformed call stays text: the harness sees what the model wrote
        episode.tool_calls += int(bool(calls))
        content = _content(text, calls, self.tool_format)
        finish = "length" if finish_reason == "length" else "stop"
        usage = (self._prompt_lens[key] + self._lengths[key] - len(turn_token_ids), len(turn_token_ids))
        lp = None
        if request.logprobs and logprobs is not None:
            lp = ([self.tokenizer.decode([t]) for t in turn_token_ids], logprobs)
        out = reply(request, self.pool.served.model, text, calls, content, finish, usage, lp)
        if request.route == "chat":
            ids = [c["id"] for c in out["choices"][0]["message"].get("tool_calls", [])]
            conv.replies.append((content or "", ids))
        else:
            conv.ids += turn_token_ids
            conv.text += text
        self.pool.step(self._ids[key], json.dumps(out))
        self._pending += 1

    def poll(self, block: bool) -> list[tuple[Key, list[int] | None]]:
        out, self._ended = self._ended, []
        while True:
            for event in self._events(block and not out):
                self._on_event(event, out)
            # Only calls of samples already over are in flight: nothing the generator waits for.
            if out or not block or self._pending <= len(self._closing):
                return _generator_keys(self._round, out)

    def next_round(self) -> tuple[list[Key], list[list[int]]]:
        """The episodes split in the round that ended and their new samples' prompts: the next
        `generate` call's prompt r (its one sample) goes on with episode keys[r]. An episode whose
        sample the generator ended while its call waited is truncated first (as in `finish`)."""
        for key, conv in self._conv.items():
            if conv.request is not None and not self.episodes[key].done and key not in self.splits:
                self.episodes[key].truncated = True
                self._end(key, None, EndpointError(400, "the model's context is full", "context_length_exceeded"))
        keys = list(self.splits)
        prompts = [self.splits.pop(key) for key in keys]
        self._round = {(r, 0): key for r, key in enumerate(keys)}
        return keys, prompts

    def _events(self, block: bool) -> Iterator[AgentEvent]:
        """The pool's next events. That of an episode being closed (its sample ended) is the
        agent's end, handled here: the reward of a truncated sample, then the episode closed.
        The others are yielded, lazily: handling one can close its episode before the next."""
        events = self.pool.events(block)
        self._pending -= len(events)
        for event in events:
            key = self._keys[event.episode]
            if key not in self._closing:
                yield event
                continue
            self._closing.discard(key)
            if self.episodes[key].failed is None:
                if event.kind == "end":
                    self._reward(key, event.value)
                else:
                    self._fail(key, f"error: the agent failed after its budget was spent ({event.error})"[:500])
            self.pool.close_episode(event.episode)

    def _on_event(self, event: AgentEvent, out: list[tuple[Key, list[int] | None]]) -> None:
        key = self._keys[event.episode]
        if self.episodes[key].done:  # the sample is over (its episode failed at the start)
            return
        if event.kind == "request":
            out.append((key, self._next_turn(key, event.value)))
            return
        if event.kind == "fail":
            self._fail(key, event.error or "error")
        else:
            self._reward(key, event.value)
        self.pool.close_episode(event.episode)
        out.append((key, None))

    def _next_turn(self, key: Key, request: Request) -> list[int] | None:
        """The harness's tokens of a later call, or None: the sample ends (rewrite, limits)."""
        episode, conv = self.episodes[key], self._conv[key]
        try:
            obs = _extend(self.tokenizer, self.template, conv, request, self._last_token[key], self.end_of_turn_ids)
        except Rewrite as e:
            if self.on_rewrite == "split":
                self._split(key, request)  # the sample ends; the episode goes on in a new one
            else:
                self._end(key, f"rewrite: {e}", EndpointError(409, f"the conversation is not the episode's: {e}"))
            return None
        except EndpointError as e:
            self._end(key, e.reason or "invalid: " + e.message, e)
            return None
        if not obs:
            self._end(key, "invalid: a call that adds no tokens", EndpointError(400, "the call adds no tokens"))
            return None
        if episode.turns >= self.max_turns or self._lengths[key] + len(obs) > self.max_total_tokens:
            episode.truncated = True
            self._end(
                key, None, EndpointError(400, "the episode's token or turn budget is spent", "context_length_exceeded")
            )
            return None
        conv.request = request
        self._lengths[key] += len(obs)
        return obs

    def _split(self, key: Key, request: Request) -> None:
        """End the sample at a call that rewrote history; the episode goes on in a new sample
        whose prompt is the call's conversation, answered in the next round (`next_round`)."""
        episode, prompt = self.episodes[key], self._open(key, request)
        if prompt is None:  # refused: the episode failed
            return
        too_long = self.max_prompt_len and len(prompt) > self.max_prompt_len
        if episode.turns >= self.max_turns or too_long:
            episode.truncated = True
            spent = EndpointError(400, "the episode's turn budget or the context is spent", "context_length_exceeded")
            self._end(key, None, spent)
            return
        episode.splits += 1
        self._prompt_lens[key] = len(prompt)
        self.splits[key] = prompt

    # ---- ends ----

    def _fail(self, key: Key, reason: str) -> None:
        episode = self.episodes[key]
        episode.failed, episode.done, episode.rewards = reason, True, [self.failure_reward]

    def _reward(self, key: Key, reward: float | None) -> None:
        episode = self.episodes[key]
        episode.done = True
        episode.score_transcript = reward is None
        episode.rewards = [0.0 if reward is None else reward]
        episode.correct = reward is not None and reward > 0

    def _end(self, key: Key, reason: str | None, error: EndpointError) -> None:
        """End the sample at a refused call: failed with `reason`, or (None) waiting for the
        agent's reward."""
        if reason is not None:
            self._fail(key, reason)
        self.episodes[key].done = True
        self._closing.add(key)
        self.pool.refuse(self._ids[key], error)
        self._pending += 1

    def finish(self) -> None:
        """End every episode: a sample the generator ended while its call waited (the model's
        context is full) is truncated as at max_total_tokens; wait for the agents whose sample
        ended early to return, then close every episode and collect the calls still in flight."""
        self.splits.clear()  # split episodes not played on (an error stopped the rounds) are truncated too
        self.next_round()
        while self._closing:
            for _ in self._events(block=True):  # the other episodes are over: their events are dropped
                pass
        for eid in self._keys:
            self.pool.close_episode(eid)
        while self._pending > 0:  # closing answers every call still waiting for its episode's event
            self._pending -= len(self.pool.events(block=True))

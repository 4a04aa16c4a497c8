"""Multi-turn rollouts: episodes of an environment driven by the paged generator.

`MultiTurnRollout` is the generator's `TurnHandler`: when a sample's turn ends, its text goes to
its environment (in a worker process) while the other samples keep decoding; the observation
comes back as tokens that the generator appends to the sample, prefilling only them (the earlier
turns' K/V stay in the sample's blocks). An episode ends when the environment says done, after
`max_turns` model turns, past `max_total_tokens`, or when its environment fails (raises, hangs,
returns garbage): that episode gets the failure reward and a recorded reason, the rest go on.
"""

from dataclasses import dataclass, field

from titanrl.envs.pool import EnvPool
from titanrl.models.tokenizer import Tokenizer


@dataclass
class Episode:
    sample: dict
    rewards: list[float] = field(default_factory=list)
    """Reward of each environment step (per-turn rewards and the final one)."""
    turns: int = 0
    tool_calls: int = 0
    correct: bool = False
    failed: str | None = None
    done: bool = False

    @property
    def reward(self) -> float:
        return sum(self.rewards)


class MultiTurnRollout:
    def __init__(self, pool: EnvPool, tokenizer: Tokenizer, max_turns: int, max_total_tokens: int,
                 failure_reward: float = 0.0) -> None:
        self.pool, self.tokenizer = pool, tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.failure_reward = failure_reward
        self.episodes: dict[tuple[int, int], Episode] = {}
        self._ids: dict[tuple[int, int], int] = {}
        self._keys: dict[int, tuple[int, int]] = {}
        self._lengths: dict[tuple[int, int], int] = {}
        self._ended: list[tuple[tuple[int, int], list[int] | None]] = []

    def start(self, samples: list[dict], group_size: int, encode_prompt) -> list[list[int]]:
        """Reset one environment per (prompt, sample) and return the prompts' token ids (the first
        observation; a group's G environments must agree on it, as they share its KV blocks)."""
        for i, sample in enumerate(samples):
            for j in range(group_size):
                key = (i, j)
                eid = len(self._ids)
                self._ids[key], self._keys[eid] = eid, key
                self.episodes[key] = Episode(sample)
                self.pool.reset(eid, sample)
        first: dict[tuple[int, int], str | None] = {}
        while len(first) < len(self._ids):
            for r in self.pool.poll(block=True):
                key = self._keys[r.episode]
                first[key] = r.value
                if r.error is not None:
                    self._fail(key, r.error)
        prompts = []
        for i in range(len(samples)):
            texts = {first[(i, j)] for j in range(group_size) if first[(i, j)] is not None}
            if len(texts) > 1:
                raise ValueError(
                    f"the environment's first observation differs between the {group_size} samples of prompt "
                    f"{i}; reset() must depend only on the sample (seed any randomness from it)"
                )
            text = texts.pop() if texts else samples[i]["prompt"]
            prompts.append(encode_prompt(text))
            for j in range(group_size):
                self._lengths[(i, j)] = 0  # completion tokens (model + environment) so far
        return prompts

    def _fail(self, key: tuple[int, int], reason: str) -> None:
        episode = self.episodes[key]
        episode.failed, episode.done = reason, True
        episode.rewards = [self.failure_reward]

    # ---- TurnHandler ----

    def submit(self, key: tuple[int, int], turn_token_ids: list[int], finish_reason: str) -> None:
        episode = self.episodes[key]
        episode.turns += 1
        self._lengths[key] += len(turn_token_ids)
        if episode.done:  # its environment already failed (at reset)
            self._ended.append((key, None))
            return
        self.pool.step(self._ids[key], self.tokenizer.decode(turn_token_ids))

    def poll(self, block: bool) -> list[tuple[tuple[int, int], list[int] | None]]:
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
            episode.rewards.append(step.reward)
            episode.correct = episode.correct or bool(step.info.get("correct", False))
            episode.tool_calls += int(bool(step.info.get("tool_call", False)))
            obs = self.tokenizer.encode(step.observation) if step.observation else []
            over = episode.turns >= self.max_turns or self._lengths[key] + len(obs) > self.max_total_tokens
            if step.done or over or not obs:
                episode.done = True
                self.pool.close_episode(r.episode)
                out.append((key, None))
                continue
            self._lengths[key] += len(obs)
            out.append((key, obs))
        return out

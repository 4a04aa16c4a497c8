"""Rollouts of agent episodes (`[agent] function`): every sample is one run of the user's agent,
whose model calls the generator answers as the sample's turns (`titanrl/envs/agent_rollout.py`).
The agent's return is the episode's reward; an agent that returns None has its transcript scored
by [reward] (the reward function, or the task's verifier), as a single-turn completion would be."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from titanrl.algorithms import get_algorithm
from titanrl.config import JobConfig
from titanrl.data.tasks import Sample
from titanrl.envs.agent_pool import AgentPool
from titanrl.envs.agent_rollout import AgentRollout
from titanrl.envs.openai_endpoint import Served
from titanrl.envs.tool_calls import resolve_tool_format
from titanrl.generator import Completion, GenerationStats, Generator, SamplingParams
from titanrl.models.chat_template import ChatTemplate
from titanrl.rewards.runner import RewardItem, RewardResult
from titanrl.rl.host import RolloutHost
from titanrl.rl.scoring import Scorer, reward_item


def build_agent_pool(config: JobConfig, template: ChatTemplate | None) -> AgentPool:
    """The rank's endpoint and agent workers for `[agent]` (its tool format checked against the
    chat template first: a one-line error at start, not at the first rollout)."""
    agent_tool_format(config.agent.tool_format, template)
    if config.agent.on_rewrite == "split" and get_algorithm(config.algorithm.name)(config.algorithm).needs_critic:
        raise ValueError(
            f"[agent] on_rewrite = 'split' gives a split sample its episode's advantage, which "
            f"algorithm.name = '{config.algorithm.name}' computes per token with a critic: set on_rewrite = 'drop'"
        )
    gen = config.generator
    return AgentPool(config.agent, Served(config.agent.model, gen.temperature, gen.top_p, gen.max_new_tokens))


def agent_tool_format(tool_format: str, template: ChatTemplate | None) -> str:
    """[agent] tool_format with 'auto' read from the chat template ('hermes' without one)."""
    if template is None:
        return "hermes" if tool_format == "auto" else tool_format
    try:
        return resolve_tool_format(tool_format, list(template.templates.values()))
    except ValueError as e:
        message = str(e).replace("env.tool_format", "agent.tool_format").replace(", 'llama3' or 'tag'", " or 'llama3'")
        raise ValueError(message.replace("[env] tool_format", "[agent] tool_format")) from None


def generate_agent_episodes(
    pool: AgentPool,
    host: RolloutHost,
    generator: Generator,
    scorer: Scorer,
    samples: list[Sample],
    params: SamplingParams,
    prompt_ids: list[int],
) -> tuple[list[list[int]], list[Completion], list[RewardResult], GenerationStats]:
    """G agent episodes per sample through the generator; their results (rewards, failures)."""
    template = host.encode_prompt.template
    return play_agent_episodes(pool, host, generator, scorer.rewards, samples, params, prompt_ids, template)


def play_agent_episodes(
    pool: AgentPool,
    host: RolloutHost,
    generator: Generator,
    rewards: Callable[[list[RewardItem]], list[RewardResult]],
    samples: list[Sample],
    params: SamplingParams,
    prompt_ids: list[int],
    template: ChatTemplate | None,
) -> tuple[list[list[int]], list[Completion], list[RewardResult], GenerationStats]:
    """`params.n` agent episodes per sample, sampled as `params` says, their chat calls rendered
    with `template`: each episode's first sample (an `EpisodeCompletion` with the samples split
    off it, [agent] on_rewrite = 'split') and its result. An agent that returns None has its last
    sample scored by `rewards` (training's [reward], or an [[eval]] suite's scorer)."""
    cfg = host.config
    pool.served = Served(cfg.agent.model, params.temperature, params.top_p, params.max_new_tokens)
    turns = AgentRollout(
        pool,
        host.tokenizer,
        template,
        agent_tool_format(cfg.agent.tool_format, template),
        cfg.agent.max_turns,
        cfg.agent.max_total_tokens,
        cfg.reward.failure_reward,
        generator.eos_ids,
        cfg.agent.on_rewrite,
    )
    turns.max_prompt_len = generator.args.max_seq_len - 2
    try:
        rows = [{"prompt": s.prompt, "answer": s.answer, "metadata": s.metadata} for s in samples]
        prompts = turns.start(rows, params.n)
        params.stop_strings = []
        completions, gen_stats = generator.generate(prompts, params, prompt_ids, turns=turns)
        completions, gen_stats = _split_rounds(turns, generator, params, prompt_ids, completions, gen_stats)
    finally:
        turns.finish()
    results = []
    for c in completions:
        episode = turns.episodes[(c.prompt_index, c.sample_index)]
        results.append(RewardResult(episode.reward, episode.correct, episode.failed, list(episode.rewards)))
    scored = [k for k, c in enumerate(completions) if turns.episodes[(c.prompt_index, c.sample_index)].score_transcript]
    if scored:  # the agents that returned None: their last sample, scored as a single-turn completion is
        last = [(split_samples(completions[k]) or [([], completions[k])])[-1][1] for k in scored]
        verdicts = rewards([reward_item(samples[completions[k].prompt_index], c) for k, c in zip(scored, last)])
        for k, verdict in zip(scored, verdicts):
            results[k] = verdict
    return prompts, completions, results, gen_stats


@dataclass
class EpisodeCompletion(Completion):
    """An agent episode's first sample, with the samples that went on after its harness rewrote
    history ([agent] on_rewrite = 'split'): they train with this sample's advantage."""

    splits: list[tuple[list[int], Completion]] = field(default_factory=list)
    """(prompt ids, completion) of each later sample, in order."""


def split_samples(c: Completion) -> list[tuple[list[int], Completion]]:
    """The samples split off `c`'s episode (none for a sample that is not an episode's)."""
    return c.splits if isinstance(c, EpisodeCompletion) else []


def _split_rounds(
    turns: AgentRollout,
    generator: Generator,
    params: SamplingParams,
    prompt_ids: list[int],
    completions: list[Completion],
    stats: GenerationStats,
) -> tuple[list[Completion], GenerationStats]:
    """Generate the samples of split episodes, a round at a time (one sample per episode, its
    own random stream: round r of episode (i, j)), until no episode splits; attach them to
    their episodes' first samples."""
    later: dict[tuple[int, int], list[tuple[list[int], Completion]]] = {}
    round_idx = 0
    while turns.splits:
        round_idx += 1
        keys, prompts = turns.next_round()
        ids = [prompt_ids[i] * params.n + j for i, j in keys]
        split_params = dataclasses.replace(params, n=1, seed=hash((params.seed or 0, round_idx)) & 0x7FFF_FFFF)
        more, more_stats = generator.generate(prompts, split_params, ids, turns=turns)
        stats = GenerationStats(**{f.name: getattr(stats, f.name) + getattr(more_stats, f.name) for f in fields(stats)})
        for c in more:
            later.setdefault(keys[c.prompt_index], []).append((prompts[c.prompt_index], c))
    out = []
    for c in completions:
        pieces = later.get((c.prompt_index, c.sample_index))
        out.append(EpisodeCompletion(**{f.name: getattr(c, f.name) for f in fields(c)}, splits=pieces) if pieces else c)
    return out, stats


def training_rows(
    prompts: list[list[int]], completions: list[Completion], group_size: int
) -> tuple[list[list[int]], list[Completion]]:
    """Each training row's prompt and completion: sample i of prompt i // group_size, then the
    samples split off agent episodes (in `split_owners` order)."""
    row_prompts = [prompts[i // group_size] for i in range(len(completions))]
    rows = list(completions)
    for c in completions:
        for prompt, piece in split_samples(c):
            row_prompts.append(prompt)
            rows.append(piece)
    return row_prompts, rows


def split_owners(completions: list[Completion]) -> list[int]:
    """For each split sample (the rows `training_rows` appends), the row of its episode."""
    return [i for i, c in enumerate(completions) for _ in split_samples(c)]


def with_split_rows(advantages: torch.Tensor, mask_BT: torch.Tensor, owners: list[int]) -> torch.Tensor:
    """The advantages of every training row: the episodes' N rows as computed (per sequence [N]
    or per token [N, T]), then each split sample's: its episode's advantage (per token: the mean
    over the episode row's trained tokens, which an outcome reward makes the same on all of
    them, on the split sample's trained tokens)."""
    if not owners:
        return advantages
    n, rows = advantages.shape[0], torch.tensor(owners, device=advantages.device)
    if advantages.dim() == 1:
        return torch.cat([advantages, advantages[rows]])
    mask_NT = mask_BT[:n].to(advantages.dtype)
    per_row_N = (advantages * mask_NT).sum(1) / mask_NT.sum(1).clamp(min=1.0)
    extra_ET = per_row_N[rows][:, None] * mask_BT[n:].to(advantages.dtype)
    return torch.cat([advantages, extra_ET])

"""Rollouts of agent episodes (`[agent] function`): every sample is one run of the user's agent,
whose model calls the generator answers as the sample's turns (`titanrl/envs/agent_rollout.py`).
The agent's return is the episode's reward; an agent that returns None has its transcript scored
by [reward] (the reward function, or the task's verifier), as a single-turn completion would be."""

from __future__ import annotations

from collections.abc import Callable

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
    with `template`; an agent that returns None has its transcript scored by `rewards` (training's
    [reward], or an [[eval]] suite's scorer)."""
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
    )
    try:
        rows = [{"prompt": s.prompt, "answer": s.answer, "metadata": s.metadata} for s in samples]
        prompts = turns.start(rows, params.n)
        params.stop_strings = []
        completions, gen_stats = generator.generate(prompts, params, prompt_ids, turns=turns)
    finally:
        turns.finish()
    results = []
    for c in completions:
        episode = turns.episodes[(c.prompt_index, c.sample_index)]
        results.append(RewardResult(episode.reward, episode.correct, episode.failed, list(episode.rewards)))
    scored = [k for k, c in enumerate(completions) if turns.episodes[(c.prompt_index, c.sample_index)].score_transcript]
    if scored:  # the agents that returned None: their transcripts, scored as single-turn completions are
        verdicts = rewards([reward_item(samples[completions[k].prompt_index], completions[k]) for k in scored])
        for k, verdict in zip(scored, verdicts):
            results[k] = verdict
    return prompts, completions, results, gen_stats

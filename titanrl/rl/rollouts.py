"""Rollouts for RL: G completions per prompt from the in-process generator, scored.

`RolloutCollector.collect` is the "generate -> reward" half of an RL step: single-turn prompts
(their verifier results streamed in as samples finish, with reward.streaming), or multi-turn
environment episodes whose steps run in the env workers while the other samples decode; DAPO's
dynamic sampling draws more prompts until the batch holds enough informative groups; an
algorithm that needs a baseline rollout (ReMax) also gets one greedy completion per prompt.
Scoring is `rl/scoring.py`'s, the groups' balance over dp ranks `rl/groups.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from titanrl.algorithms.dapo import informative_groups
from titanrl.components.faults import fault_active
from titanrl.components.timer import PhaseTimer
from titanrl.config import JobConfig
from titanrl.data.tasks import Sample
from titanrl.distributed import dp_max
from titanrl.envs.agent_pool import AgentPool
from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.multi_turn import MultiTurnRollout, ToolSetup, tool_setup
from titanrl.envs.pool import EnvPool
from titanrl.generator import Completion, GenerationStats, Generator, SamplingParams
from titanrl.models.model import Transformer
from titanrl.rewards.runner import RewardResult, RewardRunner
from titanrl.rl.agent_episodes import generate_agent_episodes
from titanrl.rl.cp_split import RolloutShare, cp_split
from titanrl.rl.groups import RolloutCounts, Rollouts
from titanrl.rl.scoring import Pending, Scorer

if TYPE_CHECKING:
    from titanrl.rl.host import RolloutHost


def step_seed(job_seed: int, step: int, round_idx: int = 0) -> int:
    """The sampling seed of a step's generation round: every sample's random stream derives from
    it and the prompt's place in its batch (`generator.scheduler.sample_key`)."""
    return hash((job_seed, step, round_idx)) & 0x7FFF_FFFF


def group_sampling_params(config: JobConfig, seed: int) -> SamplingParams:
    """G samples per prompt with the [generator] section's settings."""
    return SamplingParams(
        max_new_tokens=config.generator.max_new_tokens,
        temperature=config.generator.temperature,
        top_p=config.generator.top_p,
        top_k=config.generator.top_k,
        n=config.algorithm.group_size,
        seed=seed,
    )


class RolloutCollector:
    """Generates a step's rollouts with the in-process generator and has them scored."""

    def __init__(
        self,
        host: RolloutHost,
        generator: Generator,
        rewards: RewardRunner,
        envs: EnvPool | AsyncEnvPool | None,
        reward_model: Transformer | None,
        baseline_rollout: bool,
    ) -> None:
        self.host, self.config = host, host.config
        self.generator, self.envs = generator, envs
        self.scorer = Scorer(host, rewards, reward_model)
        self.baseline_rollout = baseline_rollout

    def state_dict(self) -> dict:
        """Rollout state to checkpoint (partial rollouts' groups in flight); none here."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        """End of the run (one-step: releases the rollout rank)."""

    def sync_generator(self, policy: torch.nn.Module) -> None:
        """Start of a step: the generator takes the policy's weights (async: they are broadcast
        to the rollout ranks inside `collect` instead)."""
        self.generator.wake()
        self.generator.load_weights(policy)

    def sampling_params(self, step: int, round_idx: int) -> SamplingParams:
        """G samples per prompt with the [generator] section's settings, seeded by (job, step, round)."""
        return group_sampling_params(self.config, step_seed(self.config.job.seed, step, round_idx))

    def generate(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int], stream: bool = False
    ) -> tuple[list[list[int]], list[Completion], Pending, GenerationStats]:
        """Completions of `samples` and, with an environment, their episodes' rewards; or with
        `stream`, their verifier results, scored in the reward workers as samples finish."""
        if self.envs is not None:  # environment steps run inside generation, overlapped with decoding
            return self.generate_episodes(samples, params, prompt_ids)
        prompts = [self.host.encode_prompt(s.prompt, s.metadata) for s in samples]
        if not stream:
            completions, gen_stats = self.generator.generate(prompts, params, prompt_ids)
            return prompts, completions, None, gen_stats
        on_finish, pending = self.scorer.stream(samples)
        completions, gen_stats = self.generator.generate(prompts, params, prompt_ids, on_finish=on_finish)
        return prompts, completions, pending, gen_stats

    @cached_property
    def tool_calls(self) -> ToolSetup:
        """How the episodes read and show tool calls (env.tool_format with the chat template): once."""
        env = self.config.env
        return tool_setup(env.name, env.tool_format, self.host.encode_prompt.template)

    def generate_episodes(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int]
    ) -> tuple[list[list[int]], list[Completion], list[RewardResult], GenerationStats]:
        """Multi-turn: every sample is an environment episode; its reward is summed over turns."""
        if isinstance(self.envs, AgentPool):  # the user's agent plays each episode ([agent])
            return generate_agent_episodes(
                self.envs, self.host, self.generator, self.scorer, samples, params, prompt_ids
            )
        env, tools = self.config.env, self.tool_calls
        assert self.envs is not None, "multi-turn rollouts need an environment pool"
        turns = MultiTurnRollout(
            self.envs,
            self.host.tokenizer,
            env.max_turns,
            env.max_total_tokens,
            self.config.reward.failure_reward,
            prompt_encoder=self.host.encode_prompt,
            observation_role=env.observation_role,
            tools=tools.tools,
            keep_tokens=tools.keep_tokens,
            end_of_turn_ids=self.generator.eos_ids,
        )
        prompts = turns.start(
            [{"prompt": s.prompt, "answer": s.answer, "metadata": s.metadata} for s in samples], params.n
        )
        params.stop_strings = tools.stop_strings
        completions, gen_stats = self.generator.generate(prompts, params, prompt_ids, turns=turns)
        results = []
        for c in completions:
            episode = turns.episodes[(c.prompt_index, c.sample_index)]
            results.append(RewardResult(episode.reward, episode.correct, episode.failed, list(episode.rewards)))
        return prompts, completions, results, gen_stats

    def rollout(self, samples: list[Sample], step: int, round_idx: int, timer: PhaseTimer) -> Rollouts:
        """Generate G samples per prompt with the current weights (and a baseline rollout when
        the algorithm needs one), then score them. Under context parallelism each cp rank generates
        and verifies its share of the prompt groups and all get the whole rollout (`rl/cp_split.py`);
        the reward model and the overlong shaping then score the whole rollout on every cp rank."""
        dims, scorer = self.host.dims, self.scorer
        params = self.sampling_params(step, round_idx)
        # Global prompt ids (the loader shards strided) seed each sample: same samples on any layout.
        prompt_ids = [i * dims.data_size + dims.data_rank for i in range(len(samples))]
        cp = cp_split(dims)
        if cp is not None:
            samples, prompt_ids = cp.take(samples), cp.take(prompt_ids)
        with timer("generate"):
            if fault_active("hang_generate", step):
                time.sleep(3600)
            if fault_active("slow_generate", step):  # a straggler: the others wait for this rank
                time.sleep(2.0)
            stream = self.config.reward.streaming and self.envs is None
            share, pending = self.generate_share(samples, params, prompt_ids, stream)
        with timer("reward"):
            share.results = scorer.verify(samples, share.completions, pending)
            if share.greedy is not None:
                share.greedy = (share.greedy[0], share.greedy[1], scorer.verify(samples, *share.greedy[1:]))
            if cp is not None:
                share = cp.gather(share)
            rewards_N, rm_sum = scorer.total_rewards(share.prompts, share.completions, share.results)
            baseline = scorer.total_rewards(*share.greedy)[0].tolist() if share.greedy is not None else []
        counts = RolloutCounts(
            gen_tokens=share.gen_tokens,
            env_turns=share.env_turns,
            env_failures=sum(r.failed is not None for r in share.results) if self.envs is not None else 0,
            rm_score_sum=rm_sum,
            decode_steps=share.decode_steps,
            compile_s=share.compile_s,
        )
        return Rollouts(share.prompts, share.completions, share.results, rewards_N.tolist(), baseline, counts)

    def generate_share(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int], stream: bool
    ) -> tuple[RolloutShare, Pending]:
        """`samples`' completions (and greedy ones for a baseline), their results not yet waited
        for; a cp rank with no prompt this round generates nothing."""
        if not samples:
            return RolloutShare.empty(self.baseline_rollout), []
        prompts, completions, results, gen_stats = self.generate(samples, params, prompt_ids, stream)
        share = RolloutShare(
            prompts,
            completions,
            [],
            gen_tokens=gen_stats.decode_tokens + gen_stats.prefill_tokens,
            env_turns=gen_stats.resumed_turns + len(completions),
            decode_steps=gen_stats.decode_steps,
            compile_s=gen_stats.compile_seconds,
        )
        if self.baseline_rollout:  # its tokens count in the throughput, not in the per-sample metrics
            greedy = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0, n=1)
            g_prompts, g_completions, g_results, greedy_stats = self.generate(samples, greedy, prompt_ids)
            # Results are None here (or an episode's): `rollout` verifies the greedy completions.
            share.greedy = (g_prompts, g_completions, g_results)  # type: ignore[assignment]
            share.gen_tokens += greedy_stats.decode_tokens + greedy_stats.prefill_tokens
        return share, results

    def collect(self, batches: Iterator, step: int, timer: PhaseTimer) -> tuple[Rollouts, Rollouts]:
        """(rollouts to train on, every rollout generated this step, with its counts, for metrics).

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and further
        prompts are drawn until this rank has its share of batch_size groups, for at most max_sampling_rounds
        rounds, all ranks in step; a batch still short is filled with dropped groups (zero advantage).
        """
        sampling, G = self.config.rollout, self.config.algorithm.group_size
        first = self.rollout(next(batches), step, 0, timer)
        quota = len(first.prompts)  # this rank's share of training.batch_size
        if not sampling.dynamic_sampling:
            return first, first
        generated: list[Rollouts] = [first]
        kept: list[Rollouts] = []
        dropped: list[Rollouts] = []
        latest: Rollouts | None = first
        for round_idx in range(1, sampling.max_sampling_rounds + 1):
            if latest is not None:  # sort the groups of this round's new rollout, once
                for i, keep in enumerate(informative_groups(torch.tensor(latest.rewards), G).tolist()):
                    (kept if keep else dropped).append(latest.group(i, G))
            # Every dp rank runs the same number of rounds (generation may be collective over tp).
            (deficit,) = dp_max([float(quota - len(kept))], self.host.dp_group)
            if deficit <= 0 or round_idx == sampling.max_sampling_rounds:
                break
            samples = next(batches)  # drawn on every rank: the loaders stay in step
            latest = None
            if len(kept) < quota:
                latest = self.rollout(samples, step, round_idx, timer)
                generated.append(latest)
        short = max(quota - len(kept), 0)
        every = Rollouts.concat(generated)
        counts = every.counts
        counts.sampling_rounds, counts.dropped_groups, counts.short_groups = len(generated), len(dropped), short
        return Rollouts.concat(kept[:quota] + dropped[:short]), every

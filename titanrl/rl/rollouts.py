"""Rollouts for RL: G completions per prompt from the in-process generator, scored.

`RolloutCollector.collect` is the "generate -> reward" half of an RL step: single-turn prompts,
or multi-turn environment episodes whose steps run in the env workers while the other samples
decode; the total reward is the weighted verifier + reward model + overlong shaping; DAPO's
dynamic sampling draws more prompts until the batch holds enough informative groups; an
algorithm that needs a baseline rollout (ReMax) also gets one greedy completion per prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titanrl.algorithms.dapo import informative_groups, overlong_penalty
from titanrl.components.faults import fault_active
from titanrl.components.plugins import load_object
from titanrl.components.timer import PhaseTimer
from titanrl.data.batch import build_sequence_batch, plan_micro_batches, trim_padding
from titanrl.data.tasks import Sample, Task
from titanrl.distributed import balance, dp_max
from titanrl.envs.pool import EnvPool
from titanrl.envs.rollout import MultiTurnRollout, ToolSetup, tool_setup
from titanrl.generator import Completion, GenerationStats, Generator, SamplingParams
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import read_generation_eos_ids
from titanrl.models.model import Transformer
from titanrl.models.scalar_head import sequence_scores
from titanrl.rewards.runner import RewardItem, RewardResult, RewardRunner
from titanrl.rl.cp_split import RolloutShare, cp_split

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titanrl.config import JobConfig
    from titanrl.models.tokenizer import Tokenizer
    from titanrl.rl.host import RolloutHost
    from titanrl.rl.stats import RLStats


def build_generator(
    config: JobConfig,
    model_args: TransformerModelArgs,
    device: torch.device,
    tokenizer: Tokenizer,
    tp_mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None,
) -> Generator:
    """The job's generator (its [generator] section, the training precision, the checkpoint's eos ids);
    `ep_mesh`: experts sharded over it as the trainer's are (`generator/ep_lockstep.py`)."""
    return Generator(
        model_args,
        config.generator,
        device,
        tp_mesh=tp_mesh,
        ep_mesh=ep_mesh,
        tokenizer=tokenizer,
        dtype=getattr(torch, config.training.mixed_precision_param),
        extra_eos_ids=read_generation_eos_ids(config.model.hf_checkpoint),
        lora=config.lora if config.lora.enable and config.lora.generator == "runtime" else None,
    )


def build_reward_runner(config: JobConfig, task: Task) -> RewardRunner:
    """Reward workers running reward.function, else the task's verifier."""
    r = config.reward
    reward_fn = load_object(r.function, "reward.function") if r.function else task
    if r.function and not callable(reward_fn):
        raise ValueError(f"reward.function '{r.function}' is not callable")
    return RewardRunner(reward_fn, r.num_workers, r.timeout_s, r.failure_reward, r.memory_limit_mb)


@dataclass
class Rollouts:
    """Generated and scored samples of some prompts: G consecutive completions per prompt."""

    prompts: list[list[int]]
    completions: list[Completion]
    results: list[RewardResult]
    rewards: list[float]
    """Total reward per completion: weighted verifier + reward model + overlong penalty."""

    baseline_rewards: list[float] = field(default_factory=list)
    """Total reward of each prompt's greedy completion (baseline rollouts); empty otherwise."""

    def group(self, i: int, G: int) -> Rollouts:
        return Rollouts(
            [self.prompts[i]],
            self.completions[i * G : (i + 1) * G],
            self.results[i * G : (i + 1) * G],
            self.rewards[i * G : (i + 1) * G],
            self.baseline_rewards[i : i + 1],
        )

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        fields = ("prompts", "completions", "results", "rewards", "baseline_rewards")
        return Rollouts(*(sum((getattr(p, f) for p in parts), []) for f in fields))


@dataclass
class _StreamedResults:
    """Verifier results being computed in the reward workers, submitted in `order`."""

    rewards: RewardRunner
    order: list[tuple[int, int]]

    def wait(self, completions: list[Completion]) -> list[RewardResult]:
        """The results, in the order of `completions`."""
        by_key = dict(zip(self.order, self.rewards.finish()))
        return [by_key[(c.prompt_index, c.sample_index)] for c in completions]


class RolloutCollector:
    def __init__(
        self,
        host: RolloutHost,
        generator: Generator,
        rewards: RewardRunner,
        envs: EnvPool | None,
        reward_model: Transformer | None,
        baseline_rollout: bool,
    ) -> None:
        self.host, self.config = host, host.config
        self.generator, self.rewards, self.envs, self.reward_model = generator, rewards, envs, reward_model
        self.baseline_rollout = baseline_rollout
        self.lengths: list[int] = []
        """Response lengths of the last step's rollouts."""
        self.decode_steps = 0
        """Decode steps of the last step's generation (all sampling rounds)."""
        self.compile_s = 0.0
        """Seconds the last step's generation spent compiling (a new batch bucket or prompt shape)."""
        self.balance_metrics: dict[str, float] = {}
        """`balance`'s last plan: the most loaded dp rank's tokens over the mean, before and
        after it, and the groups it moved."""

    def metrics(self) -> dict[str, float]:
        """The tail of this step's responses over data-parallel ranks (collective): what sets a
        synchronous step's length."""
        gathered = [self.lengths]
        if self.host.dp_group is not None:
            gathered = [None] * self.host.dims.dp_size
            dist.all_gather_object(gathered, self.lengths, group=self.host.dp_group)
        lengths_N = torch.tensor(sum(gathered, []), dtype=torch.float)
        q50, q90 = torch.quantile(lengths_N, torch.tensor([0.5, 0.9])).tolist()
        decode_steps, compile_s = dp_max([float(self.decode_steps), self.compile_s], self.host.dp_group)
        return {
            "response_len_p50": q50,
            "response_len_p90": q90,
            "response_len_max": lengths_N.max().item(),
            "decode_steps": decode_steps,
            "gen_compile_s": compile_s,
            **self.balance_metrics,
        }

    def state_dict(self) -> dict:
        """Rollout state to checkpoint (partial rollouts' groups in flight); none here."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        """End of the run (one-step: releases the rollout rank)."""

    def sampling_params(self, step: int, round_idx: int) -> SamplingParams:
        """G samples per prompt with the [generator] section's settings, seeded by (job, step, round)."""
        cfg = self.config
        return SamplingParams(
            max_new_tokens=cfg.generator.max_new_tokens,
            temperature=cfg.generator.temperature,
            top_p=cfg.generator.top_p,
            top_k=cfg.generator.top_k,
            n=cfg.algorithm.group_size,
            seed=hash((cfg.job.seed, step, round_idx)) & 0x7FFF_FFFF,
        )

    def generate(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int], stream: bool = False
    ) -> tuple[list[list[int]], list[Completion], list[RewardResult] | None, GenerationStats]:
        """Completions of `samples` and, with an environment, their episodes' rewards; or with
        `stream`, their verifier results, scored in the reward workers as samples finish."""
        if self.envs is not None:  # environment steps run inside generation, overlapped with decoding
            return self.generate_episodes(samples, params, prompt_ids)
        prompts = [self.host.encode_prompt(s.prompt, s.metadata) for s in samples]
        if not stream:
            completions, gen_stats = self.generator.generate(prompts, params, prompt_ids)
            return prompts, completions, None, gen_stats
        order: list[tuple[int, int]] = []

        def on_finish(finished: list[Completion]) -> None:
            order.extend((c.prompt_index, c.sample_index) for c in finished)
            self.rewards.submit([self._reward_item(samples[c.prompt_index], c) for c in finished])

        self.rewards.begin()
        completions, gen_stats = self.generator.generate(prompts, params, prompt_ids, on_finish=on_finish)
        return prompts, completions, _StreamedResults(self.rewards, order), gen_stats

    @staticmethod
    def _reward_item(sample: Sample, c: Completion) -> RewardItem:
        return RewardItem(sample.prompt, c.text, sample.answer, sample.metadata)

    @cached_property
    def tool_calls(self) -> ToolSetup:
        """How the episodes read and show tool calls (env.tool_format with the chat template): once."""
        env = self.config.env
        return tool_setup(env.name, env.tool_format, self.host.encode_prompt.template)

    def generate_episodes(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int]
    ) -> tuple[list[list[int]], list[Completion], list[RewardResult], GenerationStats]:
        """Multi-turn: every sample is an environment episode; its reward is summed over turns."""
        env, tools = self.config.env, self.tool_calls
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

    def score(
        self,
        samples: list[Sample],
        prompts: list[list[int]],
        completions: list[Completion],
        results: list[RewardResult] | _StreamedResults | None,
    ) -> tuple[list[RewardResult], torch.Tensor, float]:
        """(verifier results, total rewards [N], reward-model score sum); `results`: the
        episodes' (multi-turn), or the verifier's being streamed, or None to score now."""
        results = self.verify(samples, completions, results)
        return (results, *self.total_rewards(prompts, completions, results))

    def verify(
        self,
        samples: list[Sample],
        completions: list[Completion],
        results: list[RewardResult] | _StreamedResults | None,
    ) -> list[RewardResult]:
        """The verifier's (or the episodes') result of each completion, as `score` takes them."""
        if results is None:
            return self.rewards([self._reward_item(samples[c.prompt_index], c) for c in completions])
        if isinstance(results, _StreamedResults):
            return results.wait(completions)
        return results

    def total_rewards(
        self, prompts: list[list[int]], completions: list[Completion], results: list[RewardResult]
    ) -> tuple[torch.Tensor, float]:
        """(total rewards [N]: weighted verifier + reward model + overlong penalty, reward-model score sum)."""
        cfg = self.config
        rewards_N = cfg.reward.verifier_weight * torch.tensor([r.reward for r in results])
        rm_sum = 0.0
        if self.reward_model is not None:
            scores = self.reward_model_scores(
                [prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions]
            )
            rewards_N = rewards_N + cfg.reward.model_weight * scores
            rm_sum = scores.sum().item()
        if cfg.reward.overlong_buffer_len:
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            rewards_N = rewards_N + overlong_penalty(
                lengths,
                cfg.generator.max_new_tokens,
                cfg.reward.overlong_buffer_len,
                cfg.reward.overlong_penalty_factor,
            )
        return rewards_N, rm_sum

    def reward_model_scores(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """The reward model's score of each sequence [N], in micro-batches, in row order."""
        host = self.host
        batch = build_sequence_batch(prompts, completions, host.tokenizer.pad_id).to(host.device)
        scores_N = torch.zeros(len(prompts))
        lengths = batch["length"].tolist()
        for rows in plan_micro_batches(lengths, self.config.training.micro_batch_tokens, host.dp_group):
            mb = trim_padding(batch[rows])
            scores_N[rows] = sequence_scores(self.reward_model, mb["tokens"], mb["length"]).cpu()
        return scores_N

    def rollout(self, samples: list[Sample], step: int, round_idx: int, timer: PhaseTimer, stats: RLStats) -> Rollouts:
        """Generate G samples per prompt with the current weights (and a baseline rollout when
        the algorithm needs one), then score them. Under context parallelism each cp rank generates
        and verifies its share of the prompt groups and all get the whole rollout (`rl/cp_split.py`);
        the reward model and the overlong shaping then score the whole rollout on every cp rank."""
        dims = self.host.dims
        params = self.sampling_params(step, round_idx)
        # Global prompt ids (the loader shards strided) seed each sample: same samples on any layout.
        prompt_ids = [i * dims.dp_size + dims.dp_rank for i in range(len(samples))]
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
            share.results = self.verify(samples, share.completions, pending)
            if share.greedy is not None:
                share.greedy = (share.greedy[0], share.greedy[1], self.verify(samples, *share.greedy[1:]))
            if cp is not None:
                share = cp.gather(share)
            rewards_N, rm_sum = self.total_rewards(share.prompts, share.completions, share.results)
            stats.rm_score_sum += rm_sum
            baseline = self.total_rewards(*share.greedy)[0].tolist() if share.greedy is not None else []
        stats.gen_tokens += share.gen_tokens
        stats.env_turns += share.env_turns
        self.decode_steps += share.decode_steps
        self.compile_s += share.compile_s
        if self.envs is not None:
            stats.env_failures += sum(r.failed is not None for r in share.results)
        return Rollouts(share.prompts, share.completions, share.results, rewards_N.tolist(), baseline)

    def generate_share(
        self, samples: list[Sample], params: SamplingParams, prompt_ids: list[int], stream: bool
    ) -> tuple[RolloutShare, list[RewardResult] | _StreamedResults | None]:
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
            *greedy_out, greedy_stats = self.generate(samples, greedy, prompt_ids)
            share.greedy = tuple(greedy_out)
            share.gen_tokens += greedy_stats.decode_tokens + greedy_stats.prefill_tokens
        return share, results

    def collect(self, batches: Iterator, step: int, timer: PhaseTimer, stats: RLStats) -> tuple[Rollouts, Rollouts]:
        """(rollouts to train on, every rollout generated this step, for metrics)."""
        self.decode_steps, self.compile_s = 0, 0.0
        train, generated = self._collect(batches, step, timer, stats)
        self.lengths = [len(c.token_ids) for c in generated.completions]
        return train, generated

    def balance(self, train: Rollouts, timer: PhaseTimer) -> Rollouts:
        """`train`'s groups spread over the trainer's dp ranks by tokens (training.balance_tokens):
        whole groups, each rank keeping at least one. Collective."""
        cfg = self.config
        if not cfg.training.balance_tokens or self.host.dims.dp_size == 1 or cfg.algorithm.num_minibatches > 1:
            return train
        with timer("balance"):
            return self._balance(train)

    def _balance(self, train: Rollouts) -> Rollouts:
        G, group = self.config.algorithm.group_size, self.host.dp_group
        assert len(train.completions) == G * len(train.prompts)
        groups = [train.group(i, G) for i in range(len(train.prompts))]
        costs = [sum(len(g.prompts[0]) + len(c.token_ids) for c in g.completions) for g in groups]
        costs_by_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(costs_by_rank, costs, group=group)
        plan = balance.assign(costs_by_rank)
        before = [sum(c) for c in costs_by_rank]
        mean = max(sum(before) / len(before), 1.0)
        moved = sum(src != d for d, units in enumerate(plan) for src, _ in units)
        self.balance_metrics = {
            "rank_tokens_imbalance_before": max(before) / mean,
            "rank_tokens_imbalance": max(balance.loads(costs_by_rank, plan)) / mean,
            "moved_groups": float(moved),
        }
        if not moved:  # the same plan on every rank: all skip the exchange
            return train
        me = dist.get_rank(group)
        received = balance.exchange([[groups[i] for src, i in units if src == me] for units in plan], group)
        return Rollouts.concat([g for from_rank in received for g in from_rank])

    def _collect(self, batches: Iterator, step: int, timer: PhaseTimer, stats: RLStats) -> tuple[Rollouts, Rollouts]:
        """`collect`.

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and further
        prompts are drawn until this rank has its share of batch_size groups, for at most max_sampling_rounds
        rounds, all ranks in step; a batch still short is filled with dropped groups (zero advantage).
        """
        sampling, G = self.config.rollout, self.config.algorithm.group_size
        first = self.rollout(next(batches), step, 0, timer, stats)
        quota = len(first.prompts)  # this rank's share of training.batch_size
        if not sampling.dynamic_sampling:
            return first, first
        generated, kept, dropped = [first], [], []
        latest = first
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
                latest = self.rollout(samples, step, round_idx, timer, stats)
                generated.append(latest)
        short = max(quota - len(kept), 0)
        stats.sampling_rounds = len(generated)
        stats.dropped_groups += len(dropped)
        stats.short_groups += short
        return Rollouts.concat(kept[:quota] + dropped[:short]), Rollouts.concat(generated)

"""RL: the GRPO family and PPO, with the in-process generator.

    python -m titanrl.train --job.config_file train_configs/grpo_reverse_debug.toml

One step, top to bottom in `RLRecipe.step`:
  sync weights into the generator -> generate G samples per prompt and score them -> free the
  KV pool -> reference / old logprobs, critic values -> advantages (the algorithm's) -> policy
  (and critic) updates in mini-batches and micro-batches -> metrics.
What differs between GRPO, RLOO, ReMax, REINFORCE++, GSPO and PPO lives in their algorithm
object (`titanrl/algorithms/`); this file never branches on an algorithm's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict
from torch import nn

from titanrl.algorithms import AdvantageInputs, LossInputs, get_algorithm
from titanrl.algorithms.common import importance_weights, kl_estimate
from titanrl.algorithms.ppo import value_loss
from titanrl.components.loss import global_token_count
from titanrl.components.model_builder import build_critic, build_reference, build_reward_model, copy_weights
from titanrl.components.optimizer import build_optimizer
from titanrl.components.step_stats import finite_max
from titanrl.components.timer import PhaseTimer
from titanrl.config import JobConfig
from titanrl.data.batch import build_sequence_batch, split_batch, trim_padding
from titanrl.data.batch_forward import forward_logprobs, forward_values
from titanrl.data.encode import fit_prompts
from titanrl.data.loader import load_data
from titanrl.data.packing import packed_micro_batches, use_packing
from titanrl.data.prompts import build_prompt_loader, prompt_stream
from titanrl.data.tasks import Sample, Task
from titanrl.envs.agent_pool import AgentPool
from titanrl.envs.async_pool import AsyncEnvPool
from titanrl.envs.builtin import ALL_TASKS
from titanrl.envs.multi_turn import tool_setup
from titanrl.envs.pool import EnvPool
from titanrl.envs.pool_builder import build_env_pool
from titanrl.generator import SamplingParams
from titanrl.generator.routes import has_moe_layers
from titanrl.recipes.base import Recipe
from titanrl.recipes.sft import warmup
from titanrl.rewards.runner import RewardOutputLog
from titanrl.rl.agent_episodes import (
    build_agent_pool,
    split_owners,
    split_samples,
    training_rows,
    with_split_rows,
)
from titanrl.rl.async_collector import AsyncRolloutCollector
from titanrl.rl.builders import build_generator, build_reward_runner
from titanrl.rl.distillation import build_distiller
from titanrl.rl.episode_dump import EpisodeDump
from titanrl.rl.evaluation import EvalSuites, load_suites
from titanrl.rl.groups import Rollouts, balance_groups
from titanrl.rl.moe_replay import MoEMonitor, routes_batch
from titanrl.rl.partial import PartialRolloutCollector
from titanrl.rl.remote_collector import RemoteRolloutCollector
from titanrl.rl.rollouts import RolloutCollector
from titanrl.rl.scoring import reward_item
from titanrl.rl.stats import RLStats
from titanrl.trainer import loss_counts

if TYPE_CHECKING:
    from titanrl.trainer import Trainer


def rollout_collector_class(config: JobConfig) -> type[RolloutCollector]:
    """The collector of `config.rollout`: colocated (synchronous or partial), one-step or async."""
    if config.rollout.mode == "one_step":
        return RemoteRolloutCollector
    if config.rollout.mode == "async":
        return AsyncRolloutCollector
    if config.rollout.partial:
        return PartialRolloutCollector
    return RolloutCollector


def micro_batches(minibatch: TensorDict, trainer: Trainer) -> list[TensorDict]:
    """The micro-batches of `minibatch` this rank accumulates over: packed rows
    (training.packing) or padded rows of training.micro_batch_tokens."""
    training = trainer.config.training
    lengths, budget = minibatch["length"].tolist(), training.micro_batch_tokens
    if use_packing(training.packing, lengths, budget):  # each carries its packed rows
        return packed_micro_batches(minibatch, budget, trainer.dp_group)
    # Sorted by length even when whole: the rounding of every published seeded run depends on it.
    plan = trainer.plan_micro_batches(lengths, sort_single=True)
    return [trim_padding(minibatch[rows]) for rows in plan]


class RLRecipe(Recipe):
    name = "rl"
    console = {
        "reward_mean": "reward",
        "reward_std": "std",
        "accuracy": "acc",
        "response_len": "len",
        "kl": "kl",
        "entropy": "ent",
        "clip_frac": "clip",
        "grad_norm": "gnorm",
        "lr": "lr",
        "tokens_per_s": "tok/s",
        "time_generate": "gen_s",
        "time_reward": "rew_s",
        "time_logprob": "lp_s",
        "time_train": "train_s",
        "time_sync": "sync_s",
        "peak_mem_gb": "mem_gb",
        "eta_s": "eta",
        "eval_accuracy": "EVAL_ACC",
    }

    @classmethod
    def load_data(cls, config: JobConfig) -> tuple[Task, list[Sample] | None, list[Sample], list]:
        """The task, training and held-out prompts, and the [[eval]] suites with their prompts."""
        split = load_data(config, "prompts", ALL_TASKS)
        return split.task, split.train, split.held_out, load_suites(config)

    def __init__(self, trainer: Trainer, data: tuple[Task, list[Sample] | None, list[Sample], list]) -> None:
        super().__init__(trainer, data)
        cfg = self.config
        self.task = data[0]
        self.train_samples, self.eval_samples = fit_prompts(
            cfg, trainer.model_args.max_seq_len, trainer.encode_prompt, *data[1:3]
        )
        self.suites = EvalSuites(trainer, trainer.model_args.max_seq_len, data[3])
        self.console = {**type(self).console, **self.suites.console()}  # type: ignore[misc]  # per job
        self.algorithm = get_algorithm(cfg.algorithm.name)(cfg.algorithm)
        self.policy = trainer.model
        self.moe = MoEMonitor(self.policy)  # routing disagreement, expert loads, router entropy
        self.replay = cfg.moe.routing_replay == "rollout" and has_moe_layers(trainer.model_args)
        self.distiller = build_distiller(cfg, self.algorithm, trainer)  # a frozen teacher, in no checkpoint
        # The generator next: a KV pool sized from free memory is sized as the policy (and a teacher) leave it.
        tp_mesh = trainer.dims.world_mesh["tp"] if trainer.dims.tp_enabled else None
        ep_mesh = trainer.dims.world_mesh["ep"] if trainer.dims.ep_enabled else None
        self.generator = build_generator(cfg, trainer.model_args, trainer.device, trainer.tokenizer, tp_mesh, ep_mesh)
        self.generator.share_weights(self.policy)  # one rank, full-precision: one set of weights
        # The reference and the critic start as copies of the policy; `prepare` copies it again
        # after the SFT warm-up, and a resumed run loads them from its checkpoint.
        self.reference = self.critic = self.critic_optimizer = None
        if self.algorithm.needs_reference:  # a copy, or a LoRA policy's base (its adapters off)
            self.reference = build_reference(self.policy, trainer.dims, cfg, trainer.device)
        if self.algorithm.needs_critic:
            self.critic = build_critic(self.policy, trainer.dims, cfg, trainer.device)
            self.critic_optimizer = build_optimizer(self.critic, dataclasses.replace(cfg.optimizer, lr=cfg.critic.lr))
        r = cfg.reward
        self.rewards = build_reward_runner(cfg, self.task)
        self.reward_log = RewardOutputLog(cfg.job.dump_folder, trainer.rank)
        self.envs: EnvPool | AsyncEnvPool | None = None
        tools = None
        if cfg.agent.function:
            self.envs = build_agent_pool(cfg, trainer.encode_prompt.template)
        elif cfg.env.name:
            tools = tool_setup(cfg.env.name, cfg.env.tool_format, trainer.encode_prompt.template)
            self.envs = build_env_pool(cfg.env, r.memory_limit_mb, tools.env_kwargs)
        m = cfg.metrics  # a few episodes per logged step for `titanrl show`
        self.episode_dump = EpisodeDump(
            cfg.job.dump_folder, trainer.rank, m.dump_episodes, m.log_freq, trainer.tokenizer, tools, trainer.resuming
        )
        reward_model = None
        if r.model_path:
            reward_model = build_reward_model(r.model_path, trainer.dims, cfg, trainer.device, trainer.model_args)
        self.rollouts = rollout_collector_class(cfg)(
            trainer, self.generator, self.rewards, self.envs, reward_model, self.algorithm.needs_baseline_rollout
        )
        self.loader = build_prompt_loader(
            prompt_stream(self.train_samples, self.task, cfg.job.seed),
            cfg.training.batch_size,
            trainer.dims.data_rank,  # replica groups ([fault_tolerance]) take their slices too
            trainer.dims.data_size,
        )

    def checkpoint_parts(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        models = {"reference": self.reference, "critic": self.critic}
        return {k: m for k, m in models.items() if isinstance(m, nn.Module)}, (
            {"critic": self.critic_optimizer} if self.critic_optimizer is not None else {}
        )

    def state_dict(self) -> dict:
        return self.rollouts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollouts.load_state_dict(state)

    def prepare(self) -> None:
        """A fresh run: the SFT warm-up (if configured), then the reference (and a critic that
        has no checkpoint of its own) start from the policy as RL begins."""
        if self.config.sft_warmup.steps:
            before = self.trainer.evaluate(suites=False)["eval_accuracy"]  # greedy only, not [[eval]] suites
            self.trainer.metrics.log(
                -self.config.sft_warmup.steps, {"phase": "sft", "eval_accuracy_before_sft": before}
            )
            warmup(self.trainer, self.task, self.train_samples)
        if isinstance(self.reference, nn.Module):
            copy_weights(self.reference, self.policy)
        if self.critic is not None and not self.config.critic.hf_checkpoint:
            copy_weights(self.critic, self.policy, skip=("output.weight",))

    # ---- one step ----

    def step(self, batches: Iterator, step: int) -> dict[str, float]:
        cfg, algo = self.config, self.config.algorithm
        timer = PhaseTimer(self.trainer.watchdog, self.trainer.device)
        stats = RLStats()

        # 1. Generate G samples per prompt with the current policy weights, and score them.
        with timer("sync"):
            self.rollouts.sync_generator(self.policy)
        train, generated = self.rollouts.collect(batches, step, timer)
        self.generator.sleep()  # the KV pool's memory goes to training
        train, generated = balance_groups(train, generated, self.trainer, timer)  # whole groups between dp ranks
        stats.add_rollouts(generated)
        self.reward_log.write(generated.results, step)
        self.episode_dump.write(generated, step, cfg.algorithm.group_size)
        batch = self.build_batch(train, stats)

        # 2. Reference logprobs, old logprobs (only when updates go off-policy), critic values.
        off_policy = algo.ppo_epochs * algo.num_minibatches > 1
        # Packed (training.packing) or padded rows: the same [B, T-1] logprobs and values.
        invariant, chunk, pack = cfg.generator.batch_invariant, cfg.training.logprob_chunk_tokens, cfg.training.packing
        with timer("logprob"), torch.no_grad():
            if self.reference is not None:
                batch["ref_logprobs"], _ = forward_logprobs(self.reference, batch, invariant, chunk, packing=pack)
            if off_policy:
                batch["old_logprobs"], _ = forward_logprobs(
                    self.policy, batch, invariant, chunk, packing=pack, replay_routes=self.replay
                )
            if self.critic is not None:
                batch["values"] = forward_values(self.critic, batch, pack) * batch["loss_mask"]
            if self.distiller is not None:
                self.distiller.add_teacher_logprobs(batch)

        # 3. Advantages (and the critic's targets).
        owners = split_owners(train.completions)  # the episode row of each split sample's row
        episodes = batch[: len(train.completions)] if owners else batch
        advantages = self.algorithm.advantages(self.advantage_inputs(episodes, train))
        batch["advantages"] = with_split_rows(advantages.advantages, batch["loss_mask"], owners)
        if self.distiller is not None:  # per token [B, T-1]: task_reward_coef * A + coef * A_distill
            batch["advantages"] = self.distiller.advantages(advantages.advantages, batch, stats)
        if advantages.returns_BT is not None:
            batch["returns"] = advantages.returns_BT

        # 4. Updates: epochs x mini-batches of optimizer steps, micro-batches accumulate.
        grad_norms, critic_norms = [], []
        train_policy = self.critic is None or step > cfg.critic.warmup_steps
        with timer("train"):
            for _ in range(algo.ppo_epochs):
                for minibatch in split_batch(batch, algo.num_minibatches):
                    if train_policy:
                        grad_norms.append(self.update_policy(minibatch, off_policy, stats, step))
                    if self.critic is not None:
                        critic_norms.append(self.update_critic(minibatch, stats, step))
            if train_policy:
                self.trainer.lr_scheduler.step()

        # 5. Metrics, over data-parallel ranks.
        return self.step_metrics(stats.reduced(self.trainer.dp_group), generated, timer, grad_norms, critic_norms)

    def build_batch(self, train: Rollouts, stats: RLStats) -> TensorDict:
        # Row i is sample i of prompt i // G; then the samples split off agent episodes.
        prompts, completions = training_rows(train.prompts, train.completions, self.config.algorithm.group_size)
        batch = build_sequence_batch(
            prompts,
            [c.token_ids for c in completions],
            self.trainer.tokenizer.pad_id,
            [c.logprobs for c in completions],
            [c.model_mask for c in completions],  # environment tokens are not trained on
        )
        routes = routes_batch([len(p) for p in prompts], completions, batch["tokens"].shape[1])
        if routes is not None:
            batch["routes"] = routes
        batch = batch.to(self.trainer.device)
        if self.config.rollout.overlong_filter:
            truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=self.trainer.device)
            batch["loss_mask"] = batch["loss_mask"] * (~truncated)[:, None]
            stats.overlong_filtered += truncated.sum().item()
        return batch

    def advantage_inputs(self, batch: TensorDict, train: Rollouts) -> AdvantageInputs:
        algo, mask = self.config.algorithm, batch["loss_mask"]
        kl_BT = None
        if self.reference is not None and algo.kl_in_reward:
            policy_lp = batch["old_logprobs"] if "old_logprobs" in batch.keys() else batch["gen_logprobs"]
            kl_BT = self.algorithm.kl(policy_lp, batch["ref_logprobs"]) * mask
        return AdvantageInputs(
            rewards_N=torch.tensor(train.rewards).to(self.trainer.device),
            mask_BT=mask,
            kl_BT=kl_BT,
            values_BT=batch["values"] if self.critic is not None else None,
            turn_scores=train.turn_scores(self.config.reward.verifier_weight) if self.envs is not None else None,
            baseline_rewards_P=torch.tensor(train.baseline_rewards) if self.algorithm.needs_baseline_rollout else None,
            dp_group=self.trainer.dp_group,
        )

    def update_policy(self, minibatch: TensorDict, off_policy: bool, stats: RLStats, step: int) -> float:
        """One optimizer step over `minibatch`, accumulated over micro-batches; returns the grad norm.
        Statistics stay on the device (`StepStats.add_on_device`): no micro-batch waits for it."""
        algo, trainer = self.config.algorithm, self.trainer
        # Per mini-batch, not per micro-batch: the loss divides by a python float (what the
        # seeded runs were computed with) and `optimizer_step` reads the grad norm anyway.
        num_tokens, num_seqs = loss_counts(trainer, minibatch["loss_mask"], float(minibatch.batch_size[0]))
        trainer.optimizer.zero_grad()
        for mb in micro_batches(minibatch, trainer):
            logprobs, entropy = forward_logprobs(
                self.policy,
                mb,
                self.config.generator.batch_invariant,
                self.config.training.logprob_chunk_tokens,
                with_entropy=True,
                replay_routes=self.replay,
            )
            self.moe.observe(self.policy, mb)
            mask, gen = mb["loss_mask"], mb["gen_logprobs"]
            # On-policy with a single update: pi_old is this very forward, so the ratio is exactly 1.
            old = mb["old_logprobs"] if off_policy else logprobs.detach()
            is_weights, is_dropped = importance_weights(
                old, gen, algo.off_policy_correction, algo.is_cap, mask, algo.is_low, algo.is_high
            )
            ref = mb["ref_logprobs"] if self.reference is not None else None
            weights = is_weights if algo.off_policy_correction != "none" else None
            out = self.algorithm.loss(
                LossInputs(logprobs, old, mb["advantages"], mask, num_tokens, num_seqs, ref, weights)
            )
            distill_loss = (
                self.distiller.loss(self.policy, mb, num_tokens, stats) if self.distiller is not None else 0.0
            )
            trainer.backward(out.loss + distill_loss, step)
            with torch.no_grad():
                if ref is not None:
                    stats.add_on_device(kl=(self.algorithm.kl(logprobs, ref) * mask).sum())
                stats.add_on_device(
                    entropy=(entropy * mask).sum(),
                    clipped=out.clipped_tokens,
                    update_tokens=mask.sum(),
                    gen_diff=((old - gen).abs() * mask).sum(),
                    mismatch_kl=(kl_estimate(gen, old, "k3", clamp=False) * mask).sum(),
                    is_dropped=(is_dropped.float() * mask).sum(),
                )
                # Masked out as 0, not indexed away (a data-dependent shape waits for the device).
                mismatch = torch.where(mask > 0, torch.exp(old - gen), 0.0).max()
                stats.max_on_device(ratio_max=out.ratio_max, mismatch_ratio_max=mismatch)
        grad_norm = trainer.optimizer_step(self.policy, trainer.optimizer, "policy")
        stats.skipped_updates += math.isnan(grad_norm)
        return grad_norm

    def update_critic(self, minibatch: TensorDict, stats: RLStats, step: int) -> float:
        """One critic optimizer step on the clipped value loss toward the returns."""
        num_tokens = global_token_count(minibatch["loss_mask"], self.trainer.dp_group).item()
        assert self.critic is not None and self.critic_optimizer is not None, "PPO's critic"
        self.critic_optimizer.zero_grad()
        for mb in micro_batches(minibatch, self.trainer):
            mask = mb["loss_mask"]
            v_BT = forward_values(self.critic, mb)
            loss, n_clipped = value_loss(
                v_BT, mb["values"], mb["returns"], mask, self.config.critic.value_clip, num_tokens
            )
            self.trainer.backward(loss, step)
            stats.add_on_device(
                value_loss=loss.detach().double() * num_tokens, value_clipped=n_clipped, value_tokens=mask.sum()
            )
        grad_norm = self.trainer.optimizer_step(self.critic, self.critic_optimizer, "critic")
        stats.skipped_updates += math.isnan(grad_norm)
        return grad_norm

    def step_metrics(
        self, s: RLStats, generated: Rollouts, timer: PhaseTimer, grad_norms: list[float], critic_norms: list[float]
    ) -> dict[str, float]:
        algo, n, per_token = self.config.algorithm, s.samples, max(s.update_tokens, 1.0)
        r_mean = s.reward_sum / n
        metrics = {
            "reward_mean": r_mean,
            "reward_std": max(s.reward_sq_sum / n - r_mean**2, 0.0) ** 0.5,
            "accuracy": s.correct / n,
            "response_len": s.response_tokens / n,
            **s.reward_metrics(),
            "kl": s.kl / per_token,
            "entropy": s.entropy / per_token,
            "clip_frac": s.clipped / per_token,
            "ratio_max": s.ratio_max,
            # Generator vs trainer logprobs of the sampled tokens (0 only in batch-invariant mode):
            # mean |diff|, k3 KL(pi_gen || pi_trainer), the largest ratio pi_trainer / pi_gen.
            "gen_logprob_diff": s.gen_diff / per_token,
            "mismatch_kl": s.mismatch_kl / per_token,
            "mismatch_ratio_max": s.mismatch_ratio_max,
            "grad_norm": finite_max(grad_norms),
            "skipped_updates": s.skipped_updates,
            "lr": self.trainer.lr_scheduler.get_last_lr()[0],
            "tokens_per_s": s.gen_tokens / max(sum(timer.seconds.values()), 1e-9),
            **timer.metrics(),
        }
        if algo.off_policy_correction != "none":
            metrics["is_dropped_frac"] = s.is_dropped / per_token
        if self.config.rollout.dynamic_sampling:
            metrics.update(
                sampling_rounds=s.sampling_rounds, dropped_groups=s.dropped_groups, sampling_short_groups=s.short_groups
            )
        if self.config.rollout.overlong_filter:
            metrics["overlong_filtered"] = s.overlong_filtered
        metrics.update(s.rollout_metrics(generated, self.trainer.dp_group))
        metrics.update(self.moe.metrics(self.trainer.dp_group))
        if self.config.reward.model_path:
            metrics["rm_score"] = s.rm_score_sum / n
        if self.algorithm.needs_baseline_rollout:
            metrics["greedy_reward"] = s.baseline_reward_sum / s.baseline_samples
        if self.envs is not None:
            metrics.update(env_turns=s.env_turns / n, env_failures=s.env_failures)
        if self.config.agent.function and self.config.agent.on_rewrite == "split":
            splits = sum(len(split_samples(c)) for c in generated.completions)
            metrics["agent_splits"] = self.trainer.dp_sum([float(splits)])[0]
        metrics.update(s.distill_metrics() if self.distiller is not None else {})
        if self.critic is not None:
            metrics.update(
                value_loss=s.value_loss / max(s.value_tokens, 1.0),
                value_clip_frac=s.value_clipped / max(s.value_tokens, 1.0),
                critic_grad_norm=finite_max(critic_norms),
            )
        return metrics

    # ---- evaluation ----

    def evaluate(self, suites: bool = True) -> dict[str, float]:
        """Greedy accuracy on this rank's share of the held-out prompts, summed over dp ranks; and
        with `suites`, the [[eval]] suites' metrics (`titanrl/rl/evaluation.py`)."""
        dims = self.trainer.dims
        mine = self.eval_samples[dims.dp_rank :: dims.dp_size]
        self.generator.wake()
        self.generator.load_weights(self.policy)
        params = SamplingParams(max_new_tokens=self.config.generator.max_new_tokens, temperature=0.0)
        if self.envs is not None:
            _, _, results, _ = self.rollouts.generate_episodes(mine, params, list(range(len(mine))))
        else:
            completions, _ = self.generator.generate(
                [self.trainer.encode_prompt(s.prompt, s.metadata) for s in mine], params
            )
            results = self.rewards([reward_item(s, c) for s, c in zip(mine, completions)])
        agents = self.envs if isinstance(self.envs, AgentPool) else None  # [agent] plays the suites too
        suite_metrics, suite_results = self.suites.run(self.generator, agents) if suites else ({}, [])
        self.generator.sleep()
        self.reward_log.write(results + suite_results)
        correct, total, failures = self.trainer.dp_sum(
            [sum(r.correct for r in results), len(results), sum(r.failed is not None for r in results)]
        )
        metrics = {"eval_accuracy": correct / max(total, 1.0), "eval_samples": total, "eval_reward_failures": failures}
        return {**metrics, **suite_metrics}

    def close(self) -> None:
        self.rollouts.close()
        self.rewards.close()
        self.suites.close()
        if self.envs is not None:
            self.envs.close()

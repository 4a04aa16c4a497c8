"""The titanrl controller: every rank runs this file under torchrun.

    torchrun --nproc_per_node=N -m titanrl.train --job.config_file train_configs/X.toml [--section.key=value]

One RL step, top to bottom in `rl_step`:
  prompts -> sync weights into the generator -> generate G samples per prompt -> free the KV
  pool -> rewards -> (reference / old logprobs) -> group advantages -> policy update in
  mini-batches and micro-batches -> metrics.
"""

import contextlib
import dataclasses
import importlib
import os
import random
import re
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanrl.algorithms.common import (
    clipped_pg_loss,
    entropy_from_logits,
    importance_weights,
    kl_estimate,
    masked_whiten,
    token_rewards,
)
from titanrl.algorithms.dapo import informative_groups, overlong_penalty
from titanrl.algorithms.grpo import group_advantages
from titanrl.algorithms.gspo import gspo_loss
from titanrl.algorithms.ppo import gae, value_loss
from titanrl.algorithms.reinforce_pp import reinforce_pp_advantages
from titanrl.algorithms.remax import remax_advantages
from titanrl.algorithms.rloo import rloo_advantages
from titanrl.components.checkpoint import CheckpointManager, fault_active, fault_point
from titanrl.components import launch
from titanrl.components.loss import global_token_count, sft_loss, token_logprobs
from titanrl.components.metrics import MetricsLogger
from titanrl.components.model_builder import build_model
from titanrl.components.optimizer import build_lr_scheduler, build_optimizer
from titanrl.components.watchdog import Watchdog
from titanrl.config import JobConfig
from titanrl.config.job_config import Optimizer as OptimizerConfig
from titanrl.data.batch import build_sequence_batch, micro_batches, num_micro_batches, split_batch
from titanrl.data.prompts import DatasetStream, TaskStream, build_prompt_loader, load_jsonl
from titanrl.distributed import ParallelDims, all_reduce_values, clip_grad_norm_
from titanrl.envs.pool import EnvPool, resolve_env
from titanrl.envs.rollout import MultiTurnRollout
from titanrl.envs.tasks import NumericMath, Sample, Task, build_task
from titanrl.generator import Completion, GenerationStats, Generator, GeneratorOptions, SamplingParams
from titanrl.models.batch_invariant import ExactCausalAttention, batch_invariant_mode
from titanrl.models.hf import export_hf
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer, build_tokenizer
from titanrl.rewards.reward_model import build_critic, build_reward_model, sequence_scores, values
from titanrl.rewards.runner import RewardItem, RewardResult, RewardRunner

# metric -> console label (the JSONL file and wandb get every metric under its full name)
CONSOLE = {
    "reward_mean": "reward", "reward_std": "std", "accuracy": "acc", "response_len": "len", "kl": "kl",
    "entropy": "ent", "clip_frac": "clip", "grad_norm": "gnorm", "lr": "lr", "tokens_per_s": "tok/s",
    "time_generate": "gen_s", "time_reward": "rew_s", "time_logprob": "lp_s", "time_train": "train_s",
    "time_sync": "sync_s", "peak_mem_gb": "mem_gb", "eval_accuracy": "EVAL_ACC",
}


@dataclass
class Context:
    """What the loop needs, built once in `main`."""

    config: JobConfig
    dims: ParallelDims
    device: torch.device
    tokenizer: Tokenizer
    task: Task
    policy: Transformer
    reference: Transformer | None
    generator: Generator
    rewards: RewardRunner
    metrics: MetricsLogger
    dp_group: dist.ProcessGroup | None
    watchdog: Watchdog
    reward_model: Transformer | None = None
    envs: EnvPool | None = None
    """Environment workers of a multi-turn task (env.name), else None."""
    critic: Transformer | None = None
    critic_optimizer: torch.optim.Optimizer | None = None


class PhaseTimer:
    """Times each phase of a step, under the watchdog, and its memory: on CUDA the peak allocated
    during the phase; on CPU the process's resident memory when the phase ends."""

    def __init__(self, watchdog: Watchdog, device: torch.device) -> None:
        self.watchdog, self.device = watchdog, device
        self.seconds: dict[str, float] = defaultdict(float)
        self.memory_gb: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.watchdog.phase(phase):
            yield
        self.seconds[phase] += time.perf_counter() - start
        self.memory_gb[phase] = max(self.memory_gb[phase], phase_memory_gb(self.device))


def dp_sum(values: list[float], ctx: Context) -> list[float]:
    """Sum each value over data-parallel ranks (TP peers hold equal copies and are not counted)."""
    return all_reduce_values(values, ctx.dp_group, dist.ReduceOp.SUM)


def dp_max(values: list[float], ctx: Context) -> list[float]:
    return all_reduce_values(values, ctx.dp_group, dist.ReduceOp.MAX)


def encode_prompt(ctx: Context, sample: Sample) -> list[int]:
    bos = [ctx.tokenizer.bos_id] if ctx.tokenizer.bos_id is not None else []
    return bos + ctx.tokenizer.encode(sample.prompt)


def forward_logprobs(model: Transformer, batch: TensorDict, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs of the next tokens [B, T-1], logits [B, T-1, V]) as the trainer computes them."""
    tokens_BT = batch["tokens"]
    if invariant:
        with batch_invariant_mode():
            logits = model(tokens_BT[:, :-1], backend=ExactCausalAttention())
    else:
        logits = model(tokens_BT[:, :-1])
    return token_logprobs(logits, tokens_BT[:, 1:]), logits


# ---- SFT warm-up ----

def demonstration_tokens(tokenizer: Tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of a sample's worked solution + eos; a multi-turn demonstration
    (metadata 'demo' = [[text, from_model], ...]) masks out the environment's text."""
    demo = sample.metadata.get("demo") or [[sample.solution, True]]
    tokens, mask = [], []
    for text, from_model in demo:
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [int(bool(from_model))] * len(ids)
    return tokens + [tokenizer.eos_id], mask + [1]

def sft_warmup(ctx: Context, train_samples: list[Sample] | None) -> None:
    """Supervised steps on worked solutions (the task's, or the data's 'solution' field, else
    its answer) so that a from-scratch model can start RL."""
    cfg = ctx.config.training
    opt = build_optimizer(ctx.policy, OptimizerConfig(lr=cfg.warmup_sft_lr, beta2=0.99, weight_decay=0.0))
    stream = (
        DatasetStream(train_samples, seed=ctx.config.job.seed + 7919) if train_samples
        else TaskStream(ctx.task, seed=ctx.config.job.seed + 7919)
    )
    loader = build_prompt_loader(stream, cfg.warmup_sft_batch_size, ctx.dims.dp_rank, ctx.dims.dp_size)
    eos = ctx.tokenizer.eos_id
    batches = iter(loader)
    for step in range(1, cfg.warmup_sft_steps + 1):
        samples = next(batches)
        prompts = [encode_prompt(ctx, s) for s in samples]
        answers, masks = zip(*(demonstration_tokens(ctx.tokenizer, s) for s in samples))
        batch = build_sequence_batch(prompts, list(answers), ctx.tokenizer.pad_id, None, list(masks)).to(ctx.device)
        num_tokens = global_token_count(batch["loss_mask"], ctx.dp_group)
        opt.zero_grad()
        # Without a token budget the batch stays whole and in order (sorting would change the
        # sums' rounding, and with it every seeded run's numbers).
        micros = equal_micro_batches(ctx, batch) if cfg.micro_batch_tokens else [batch]
        local_loss = 0.0
        for micro in micros:
            tokens_BT = micro["tokens"]
            loss = sft_loss(ctx.policy(tokens_BT[:, :-1]), tokens_BT[:, 1:], micro["loss_mask"], num_tokens)
            loss.backward()
            local_loss += loss.item()
        clip_grad_norm_(list(ctx.policy.parameters()), cfg.max_norm)
        opt.step()
        if step % 25 == 0 or step == cfg.warmup_sft_steps:
            (global_loss,) = dp_sum([local_loss], ctx)
            ctx.metrics.log(step - cfg.warmup_sft_steps,
                            {"phase": "sft", "sft_loss": global_loss, "sft_micro_batches": len(micros)})


# ---- evaluation ----

def evaluate(ctx: Context, eval_samples: list[Sample]) -> dict[str, float]:
    """Greedy accuracy on this rank's share of the held-out prompts, summed over dp ranks."""
    with ctx.watchdog.phase("eval"):
        return _evaluate(ctx, eval_samples)


def _evaluate(ctx: Context, eval_samples: list[Sample]) -> dict[str, float]:
    mine = eval_samples[ctx.dims.dp_rank :: ctx.dims.dp_size]
    ctx.generator.wake()
    ctx.generator.load_weights(ctx.policy)
    params = SamplingParams(max_new_tokens=ctx.config.generator.max_new_tokens, temperature=0.0)
    if ctx.envs is not None:
        _, _, results, _ = generate_episodes(ctx, mine, params, list(range(len(mine))))
        ctx.generator.sleep()
    else:
        completions, _ = ctx.generator.generate([encode_prompt(ctx, s) for s in mine], params)
        ctx.generator.sleep()
        results = ctx.rewards([RewardItem(s.prompt, c.text, s.answer, s.metadata) for s, c in zip(mine, completions)])
    correct, total = dp_sum([sum(r.correct for r in results), len(results)], ctx)
    return {"eval_accuracy": correct / max(total, 1.0), "eval_samples": total}


# ---- one RL step ----

@dataclass
class Rollouts:
    """Generated and scored samples of some prompts: G consecutive completions per prompt."""

    prompts: list[list[int]]
    completions: list[Completion]
    results: list[RewardResult]
    rewards: list[float]
    """Total reward per completion: weighted verifier + reward model + overlong penalty."""

    greedy_rewards: list[float] = field(default_factory=list)
    """ReMax: total reward of each prompt's greedy completion (the baseline); empty otherwise."""

    def group(self, i: int, G: int) -> "Rollouts":
        return Rollouts([self.prompts[i]], self.completions[i * G : (i + 1) * G], self.results[i * G : (i + 1) * G],
                        self.rewards[i * G : (i + 1) * G], self.greedy_rewards[i : i + 1])

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        return Rollouts(*(sum((getattr(p, f) for p in parts), []) for f in ("prompts", "completions", "results",
                                                                                  "rewards", "greedy_rewards")))


def generate_episodes(ctx: Context, samples: list[Sample], params: SamplingParams, prompt_ids: list[int]
                      ) -> tuple[list[list[int]], list[Completion], list[RewardResult], GenerationStats]:
    """Multi-turn: every sample is an environment episode; its steps run in the env workers
    while the other samples decode, and give its reward (summed over turns)."""
    env = ctx.config.env
    turns = MultiTurnRollout(ctx.envs, ctx.tokenizer, env.max_turns, env.max_total_tokens,
                             ctx.config.reward.failure_reward)
    bos = [ctx.tokenizer.bos_id] if ctx.tokenizer.bos_id is not None else []
    prompts = turns.start([{"prompt": s.prompt, "answer": s.answer, "metadata": s.metadata} for s in samples],
                          params.n, lambda text: bos + ctx.tokenizer.encode(text))
    params.stop_strings = list(getattr(resolve_env(env.name), "stop_strings", ()))
    completions, gen_stats = ctx.generator.generate(prompts, params, prompt_ids, turns=turns)
    results = []
    for c in completions:
        episode = turns.episodes[(c.prompt_index, c.sample_index)]
        results.append(RewardResult(episode.reward, episode.correct, episode.failed, list(episode.rewards)))
    return prompts, completions, results, gen_stats


def generate(ctx: Context, samples: list[Sample], params: SamplingParams, prompt_ids: list[int]
             ) -> tuple[list[list[int]], list[Completion], list[RewardResult] | None, GenerationStats]:
    """Completions of `samples` (and, with an environment, their episodes' rewards)."""
    if ctx.envs is not None:  # environment steps run inside generation, overlapped with decoding
        return generate_episodes(ctx, samples, params, prompt_ids)
    prompts = [encode_prompt(ctx, s) for s in samples]
    completions, gen_stats = ctx.generator.generate(prompts, params, prompt_ids)
    return prompts, completions, None, gen_stats


def score(ctx: Context, samples: list[Sample], prompts: list[list[int]], completions: list[Completion],
          results: list[RewardResult] | None, stats: dict) -> tuple[list[RewardResult], torch.Tensor]:
    """Verifier results and total rewards: weighted verifier + reward model + overlong penalty."""
    cfg = ctx.config
    if results is None:
        results = ctx.rewards([
            RewardItem(samples[c.prompt_index].prompt, c.text, samples[c.prompt_index].answer,
                       samples[c.prompt_index].metadata)
            for c in completions
        ])
    rewards_N = cfg.reward.verifier_weight * torch.tensor([r.reward for r in results])
    if ctx.reward_model is not None:
        batch = build_sequence_batch([prompts[c.prompt_index] for c in completions],
                                     [c.token_ids for c in completions], ctx.tokenizer.pad_id).to(ctx.device)
        scores = torch.cat([sequence_scores(ctx.reward_model, mb["tokens"], mb["length"])
                            for mb in equal_micro_batches(ctx, batch, sort=False)])
        rewards_N = rewards_N + cfg.reward.model_weight * scores.cpu()
        stats["rm_score_sum"] += scores.sum().item()
    if cfg.algorithm.overlong_buffer_len:
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        rewards_N = rewards_N + overlong_penalty(lengths, cfg.generator.max_new_tokens,
                                                 cfg.algorithm.overlong_buffer_len,
                                                 cfg.algorithm.overlong_penalty_factor)
    return results, rewards_N


def rollout(ctx: Context, samples: list[Sample], step: int, round_idx: int, timer: "PhaseTimer",
            stats: dict) -> Rollouts:
    """Generate G samples per prompt with the current weights (and, for ReMax, one greedy
    completion per prompt as the baseline), then score them."""
    cfg, G = ctx.config, ctx.config.algorithm.group_size
    params = SamplingParams(
        max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
        top_p=cfg.generator.top_p, top_k=cfg.generator.top_k, n=G,
        seed=hash((cfg.job.seed, step, round_idx)) & 0x7FFF_FFFF,
    )
    # Global prompt ids (the loader shards strided) seed each sample: same samples on any layout.
    prompt_ids = [i * ctx.dims.dp_size + ctx.dims.dp_rank for i in range(len(samples))]
    remax = cfg.algorithm.name == "remax"
    with timer("generate"):
        if fault_active("hang_generate", step):
            time.sleep(3600)
        prompts, completions, results, gen_stats = generate(ctx, samples, params, prompt_ids)
        stats["gen_tokens"] += gen_stats.decode_tokens + gen_stats.prefill_tokens
        stats["env_turns"] += gen_stats.resumed_turns + len(completions)
        if remax:  # the baseline's tokens count in the throughput, not in the per-sample metrics
            greedy = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=0.0, n=1)
            *greedy_out, greedy_stats = generate(ctx, samples, greedy, prompt_ids)
            stats["gen_tokens"] += greedy_stats.decode_tokens + greedy_stats.prefill_tokens
    with timer("reward"):
        results, rewards_N = score(ctx, samples, prompts, completions, results, stats)
        greedy_rewards = score(ctx, samples, *greedy_out, defaultdict(float))[1].tolist() if remax else []
    if ctx.envs is not None:
        stats["env_failures"] += sum(r.failed is not None for r in results)
    return Rollouts(prompts, completions, results, rewards_N.tolist(), greedy_rewards)


def collect(ctx: Context, loader, step: int, timer: "PhaseTimer", stats: dict) -> tuple[Rollouts, Rollouts]:
    """(rollouts to train on, every rollout generated this step, for metrics).

    With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and further
    prompts are drawn until this rank has batch_size groups, for at most max_sampling_rounds
    rounds, all ranks in step; a batch still short is filled with dropped groups (zero advantage).
    """
    algo, quota, G = ctx.config.algorithm, ctx.config.training.batch_size, ctx.config.algorithm.group_size
    first = rollout(ctx, next(loader), step, 0, timer, stats)
    if not algo.dynamic_sampling:
        return first, first
    generated, kept, dropped = [first], [], []
    for round_idx in range(1, algo.max_sampling_rounds + 1):
        latest = generated[-1]
        informative = informative_groups(torch.tensor(latest.rewards), G).tolist()
        for i, keep in enumerate(informative):
            (kept if keep else dropped).append(latest.group(i, G))
        # Every dp rank runs the same number of rounds (generation may be collective over tp).
        (deficit,) = dp_max([float(quota - len(kept))], ctx)
        if deficit <= 0 or round_idx == algo.max_sampling_rounds:
            break
        samples = next(loader)
        if len(kept) >= quota:
            continue
        generated.append(rollout(ctx, samples, step, round_idx, timer, stats))
    stats["sampling_rounds"] = len(generated)
    stats["dropped_groups"] = len(dropped)
    short = max(quota - len(kept), 0)
    stats["short_groups"] = short
    return Rollouts.concat(kept[:quota] + dropped[:short]), Rollouts.concat(generated)


def rl_step(ctx: Context, loader, step: int, optimizer, scheduler) -> dict[str, float]:
    cfg, algo = ctx.config, ctx.config.algorithm
    timer = PhaseTimer(ctx.watchdog, ctx.device)
    stats: dict[str, float] = defaultdict(float)

    # 1. Generate G samples per prompt with the current policy weights, and score them.
    with timer("sync"):
        ctx.generator.wake()
        ctx.generator.load_weights(ctx.policy)
    train, generated = collect(ctx, loader, step, timer, stats)
    ctx.generator.sleep()  # the KV pool's memory goes to training
    rewards_N = torch.tensor(train.rewards)

    batch = build_sequence_batch(
        [train.prompts[i // algo.group_size] for i in range(len(train.completions))],
        [c.token_ids for c in train.completions], ctx.tokenizer.pad_id, [c.logprobs for c in train.completions],
        [c.model_mask for c in train.completions],  # environment tokens are not trained on
    ).to(ctx.device)
    if algo.overlong_filter:
        truncated = torch.tensor([c.finish_reason == "length" for c in train.completions], device=ctx.device)
        batch["loss_mask"] = batch["loss_mask"] * (~truncated)[:, None]
        stats["overlong_filtered"] = truncated.sum().item()

    # 2. Reference logprobs, old logprobs (only when updates go off-policy), critic values.
    off_policy = algo.ppo_epochs * algo.num_minibatches > 1
    with timer("logprob"), torch.no_grad():
        if algo.kl_coef > 0:
            batch["ref_logprobs"], _ = forward_logprobs(ctx.reference, batch, cfg.generator.batch_invariant)
        if off_policy:
            batch["old_logprobs"], _ = forward_logprobs(ctx.policy, batch, cfg.generator.batch_invariant)
        if ctx.critic is not None:
            batch["values"] = values(ctx.critic, batch["tokens"]) * batch["loss_mask"]

    # 3. Advantages.
    batch["advantages"] = compute_advantages(ctx, batch, rewards_N, turn_scores(ctx, train), train.greedy_rewards)

    # 4. Updates: epochs x mini-batches of optimizer steps, micro-batches accumulate.
    sums = defaultdict(float)
    grad_norms, critic_norms = [], []
    train_policy = ctx.critic is None or step > cfg.critic.warmup_steps
    with timer("train"):
        for _ in range(algo.ppo_epochs):
            for minibatch in split_batch(batch, algo.num_minibatches):
                if train_policy:
                    grad_norms.append(update(ctx, minibatch, optimizer, off_policy, sums, step))
                if ctx.critic is not None:
                    critic_norms.append(update_critic(ctx, minibatch, sums))
        if train_policy:
            scheduler.step()

    # 5. Metrics, summed over data-parallel ranks.
    results, all_rewards = generated.results, torch.tensor(generated.rewards)
    totals = dp_sum([
        all_rewards.sum().item(), (all_rewards**2).sum().item(), sum(r.correct for r in results), len(results),
        sum(len(c.token_ids) for c in generated.completions), sum(r.failed is not None for r in results),
        sums["kl"], sums["entropy"], sums["clipped"], sums["tokens"], sums["gen_diff"], stats["gen_tokens"],
        sums["mismatch_kl"], sums["is_dropped"], stats["dropped_groups"], stats["short_groups"],
        stats["overlong_filtered"], stats["rm_score_sum"], sums["value_loss"], sums["value_clipped"],
        sums["value_tokens"],
    ], ctx)
    (r_sum, r_sq, n_correct, n, toks, failed, kl, ent, clipped, upd_tokens, gen_diff, gen_tokens,
     mismatch_kl, is_dropped, dropped_groups, short_groups, overlong_filtered, rm_sum, v_loss, v_clipped,
     v_tokens) = totals
    (ratio_max, mismatch_ratio_max) = dp_max([sums["ratio_max"], sums["mismatch_ratio_max"]], ctx)
    r_mean = r_sum / n
    step_time = sum(timer.seconds.values())
    per_token = max(upd_tokens, 1.0)
    metrics = {
        "reward_mean": r_mean,
        "reward_std": max(r_sq / n - r_mean**2, 0.0) ** 0.5,
        "accuracy": n_correct / n,
        "response_len": toks / n,
        "reward_failures": failed,
        "kl": kl / per_token,
        "entropy": ent / per_token,
        "clip_frac": clipped / per_token,
        "ratio_max": ratio_max,
        # Generator vs trainer logprobs of the sampled tokens (0 only in batch-invariant mode):
        # mean |diff|, k3 KL(pi_gen || pi_trainer), the largest ratio pi_trainer / pi_gen.
        "gen_logprob_diff": gen_diff / per_token,
        "mismatch_kl": mismatch_kl / per_token,
        "mismatch_ratio_max": mismatch_ratio_max,
        "grad_norm": _finite_max(grad_norms),
        "skipped_updates": sums["skipped_updates"],
        "lr": scheduler.get_last_lr()[0],
        "tokens_per_s": gen_tokens / max(step_time, 1e-9),
        **{f"time_{k}": v for k, v in timer.seconds.items()},
        **{f"mem_{k}_gb": v for k, v in timer.memory_gb.items()},
        # (On CUDA each phase resets the peak counter, so the step's peak is the phases' max.)
        "peak_mem_gb": max(timer.memory_gb.values()) if ctx.device.type == "cuda" else peak_memory_gb(ctx.device),
    }
    if algo.off_policy_correction != "none":
        metrics["is_dropped_frac"] = is_dropped / per_token
    if algo.dynamic_sampling:
        metrics.update(sampling_rounds=stats["sampling_rounds"], dropped_groups=dropped_groups,
                       sampling_short_groups=short_groups)
    if algo.overlong_filter:
        metrics["overlong_filtered"] = overlong_filtered
    if ctx.reward_model is not None:
        metrics["rm_score"] = rm_sum / n
    if algo.name == "remax":
        greedy_sum, greedy_n = dp_sum([sum(generated.greedy_rewards), len(generated.greedy_rewards)], ctx)
        metrics["greedy_reward"] = greedy_sum / greedy_n
    if ctx.envs is not None:
        env_turns, env_failures = dp_sum([stats["env_turns"], stats["env_failures"]], ctx)
        metrics.update(env_turns=env_turns / n, env_failures=env_failures)
    if ctx.critic is not None:
        metrics.update(value_loss=v_loss / max(v_tokens, 1.0), value_clip_frac=v_clipped / max(v_tokens, 1.0),
                       critic_grad_norm=_finite_max(critic_norms))
    return metrics


def _finite_max(values: list[float]) -> float:
    return max(values, key=lambda g: g if g == g else float("-inf")) if values else float("nan")


def turn_scores(ctx: Context, rollouts: Rollouts) -> list[list[float]] | None:
    """Multi-turn: each episode's per-turn rewards (weighted), with whatever else its total holds
    (reward model, length penalty) on the last turn, so that they sum to the total."""
    if ctx.envs is None:
        return None
    out = []
    for result, total in zip(rollouts.results, rollouts.rewards):
        scores = [ctx.config.reward.verifier_weight * r for r in result.turn_rewards or [0.0]]
        scores[-1] += total - sum(scores)
        out.append(scores)
    return out


def compute_advantages(ctx: Context, batch: TensorDict, rewards_N: torch.Tensor,
                       turn_scores: list[list[float]] | None = None,
                       greedy_rewards_P: list[float] | None = None) -> torch.Tensor:
    """Per-sequence [B] (group or greedy baselines) or per-token [B, T] (REINFORCE++, PPO)
    advantages; the token-level ones place multi-turn episodes' per-turn rewards at the end of
    each turn."""
    algo, mask = ctx.config.algorithm, batch["loss_mask"]
    rewards_N = rewards_N.to(ctx.device)
    kl_BT = None
    if algo.kl_coef > 0 and algo.kl_in_reward:
        policy_lp = batch["old_logprobs"] if "old_logprobs" in batch.keys() else batch["gen_logprobs"]
        kl_BT = kl_estimate(policy_lp, batch["ref_logprobs"], algo.kl_estimator) * mask
    if algo.name == "ppo":
        token_r = token_rewards(rewards_N, mask, kl_BT, algo.kl_coef, turn_scores)
        adv_BT, batch["returns"] = gae(token_r, batch["values"], mask, algo.gamma, algo.lam)
        return masked_whiten(adv_BT, mask, ctx.dp_group)
    if algo.name == "reinforce_pp":
        return reinforce_pp_advantages(rewards_N, mask, kl_BT, algo.kl_coef, algo.gamma, ctx.dp_group, turn_scores)
    # Group baselines (all G samples of a prompt live on this rank): sequence KL in the reward.
    shaped_N = rewards_N if kl_BT is None else rewards_N - algo.kl_coef * kl_BT.sum(-1)
    if algo.name == "rloo":
        return rloo_advantages(shaped_N, algo.group_size)
    if algo.name == "remax":
        return remax_advantages(shaped_N, torch.tensor(greedy_rewards_P), algo.group_size)
    return group_advantages(shaped_N, algo.group_size, algo.normalize_std)


def equal_micro_batches(ctx: Context, batch: TensorDict, sort: bool = True) -> list[TensorDict]:
    """Micro-batches of about training.micro_batch_tokens, as many on every dp rank (FSDP runs
    collectives in each forward/backward). Unsorted keeps row order (for scores)."""
    (n_micro,) = dp_max([num_micro_batches(batch["length"].tolist(), ctx.config.training.micro_batch_tokens)], ctx)
    n = int(min(n_micro, batch.batch_size[0]))
    if sort:
        return micro_batches(batch, n)
    return split_batch(batch, n) if batch.batch_size[0] % n == 0 else micro_batches(batch, n)


def update(ctx: Context, minibatch: TensorDict, optimizer, off_policy: bool, sums: dict, step: int) -> float:
    """One optimizer step over `minibatch`, accumulated over micro-batches; returns the grad norm."""
    algo, cfg = ctx.config.algorithm, ctx.config
    num_tokens = global_token_count(minibatch["loss_mask"], ctx.dp_group).item()
    (num_seqs,) = dp_sum([float(minibatch.batch_size[0])], ctx)
    optimizer.zero_grad()
    for mb in equal_micro_batches(ctx, minibatch):
        logprobs, logits = forward_logprobs(ctx.policy, mb, cfg.generator.batch_invariant)
        mask = mb["loss_mask"]
        # On-policy with a single update: pi_old is this very forward, so the ratio is exactly 1.
        old = mb["old_logprobs"] if off_policy else logprobs.detach()
        is_weights, is_dropped = importance_weights(old, mb["gen_logprobs"], algo.off_policy_correction, algo.is_cap)
        kw = dict(
            clip_low=algo.clip_eps_low, clip_high=algo.clip_eps_high, num_global_tokens=num_tokens,
            num_global_seqs=num_seqs, kl_estimator=algo.kl_estimator,
            ref_logprobs_BT=mb["ref_logprobs"] if algo.kl_coef > 0 and not algo.kl_in_reward else None,
            kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
            is_weights_BT=is_weights if algo.off_policy_correction != "none" else None,
        )
        if algo.name == "gspo":
            out = gspo_loss(logprobs, old, mb["advantages"], mask, **kw)
        else:
            out = clipped_pg_loss(logprobs, old, mb["advantages"], mask, loss_agg=algo.loss_agg, **kw)
        loss = out.loss * float("nan") if fault_active("nan_loss", step) else out.loss
        loss.backward()
        with torch.no_grad():
            if algo.kl_coef > 0:
                sums["kl"] += (kl_estimate(logprobs, mb["ref_logprobs"], algo.kl_estimator) * mask).sum().item()
            sums["entropy"] += (entropy_from_logits(logits) * mask).sum().item()
            sums["clipped"] += out.clipped_tokens.item()
            sums["tokens"] += mask.sum().item()
            sums["gen_diff"] += ((old - mb["gen_logprobs"]).abs() * mask).sum().item()
            sums["mismatch_kl"] += (kl_estimate(mb["gen_logprobs"], old, "k3") * mask).sum().item()
            sums["is_dropped"] += (is_dropped.float() * mask).sum().item()
            sums["ratio_max"] = max(sums["ratio_max"], out.ratio_max.item())
            if mask.any():
                mismatch = torch.exp(old - mb["gen_logprobs"])[mask > 0].max().item()
                sums["mismatch_ratio_max"] = max(sums["mismatch_ratio_max"], mismatch)
    return _step_optimizer(ctx, ctx.policy, optimizer, sums, "policy")


def update_critic(ctx: Context, minibatch: TensorDict, sums: dict) -> float:
    """One critic optimizer step on the clipped value loss toward the GAE returns."""
    num_tokens = global_token_count(minibatch["loss_mask"], ctx.dp_group).item()
    ctx.critic_optimizer.zero_grad()
    for mb in equal_micro_batches(ctx, minibatch):
        mask = mb["loss_mask"]
        v_BT = values(ctx.critic, mb["tokens"])
        loss, n_clipped = value_loss(v_BT, mb["values"], mb["returns"], mask, ctx.config.critic.value_clip, num_tokens)
        loss.backward()
        sums["value_loss"] += loss.item() * num_tokens
        sums["value_clipped"] += n_clipped.item()
        sums["value_tokens"] += mask.sum().item()
    return _step_optimizer(ctx, ctx.critic, ctx.critic_optimizer, sums, "critic")


def _step_optimizer(ctx: Context, model: Transformer, optimizer, sums: dict, what: str) -> float:
    """Clip, then step unless the gradient is non-finite (skip and count, or stop: config)."""
    cfg = ctx.config
    grad_norm = clip_grad_norm_(list(model.parameters()), cfg.training.max_norm)
    # The norm is global (all ranks agree), so every rank takes the same branch.
    if not torch.isfinite(grad_norm):
        if cfg.training.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite gradient norm in the {what} update (loss or logprobs overflowed); "
                "lower optimizer.lr, check rewards, or set training.on_nonfinite = 'skip'"
            )
        optimizer.zero_grad()
        sums["skipped_updates"] += 1
        return float("nan")
    optimizer.step()
    return grad_norm.item()


def phase_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---- set-up ----

def resuming(config: JobConfig) -> bool:
    folder = os.path.join(config.job.dump_folder, config.checkpoint.folder)
    has_latest = bool(CheckpointManager(folder, 0).complete_steps())
    return config.checkpoint.enable and (bool(config.checkpoint.load_path) or has_latest)


def build_context(config: JobConfig, rank: int, dims: ParallelDims, device: torch.device) -> Context:
    tokenizer = build_tokenizer(config.model.tokenizer)
    model_args = launch.model_args(config, tokenizer.vocab_size)
    policy = build_model(model_args, dims, config, device, hf_checkpoint=config.model.hf_checkpoint)
    tp_mesh = dims.world_mesh["tp"] if dims.tp_enabled else None
    gcfg = config.generator
    generator = Generator(
        model_args,
        GeneratorOptions(
            block_size=gcfg.block_size, num_blocks=gcfg.num_blocks, memory_fraction=gcfg.kv_cache_memory_fraction,
            max_num_seqs=gcfg.max_num_seqs, enable_prefix_caching=gcfg.enable_prefix_caching,
            eos_id=tokenizer.eos_id, batch_invariant=gcfg.batch_invariant, compile=gcfg.compile,
            attention_impl=gcfg.attention_impl,
        ),
        device, tp_mesh=tp_mesh, tokenizer=tokenizer,
    )
    task: Task = NumericMath() if config.data.task == "jsonl" else build_task(config.data.task)
    reward_fn = import_callable(config.reward.function) if config.reward.function else task
    rewards = RewardRunner(
        reward_fn, config.reward.num_workers, config.reward.timeout_s, config.reward.failure_reward,
        config.reward.memory_limit_mb,
    )
    envs = None
    if config.env.name:
        envs = EnvPool(config.env.name, {}, config.env.num_workers, config.env.timeout_s, config.reward.memory_limit_mb)
    reward_model = None
    if config.reward.model_path:
        reward_model = build_reward_model(config.reward.model_path, dims, config, device, model_args)
    return Context(
        config=config, dims=dims, device=device, tokenizer=tokenizer, task=task, policy=policy, reference=None,
        reward_model=reward_model, envs=envs,
        generator=generator, rewards=rewards, metrics=MetricsLogger(config, rank, append=resuming(config)),
        dp_group=dims.dp_mesh.get_group() if dims.dp_size > 1 else None,
        watchdog=Watchdog(config.job.phase_timeout_s, rank),
    )


def import_callable(spec: str):
    """'package.module:name' -> the object (a user's reward function)."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"reward.function '{spec}' cannot be imported ({e}); use 'module:callable' with the module "
            "on PYTHONPATH"
        ) from None
    if not callable(fn):
        raise ValueError(f"reward.function '{spec}' is not callable")
    return fn


def main(argv: list[str] | None = None) -> dict[str, float]:
    config = launch.parse_args(argv)
    if config is None:
        return {}
    rank, dims, device = launch.start(config)
    # Read user data before building anything, so that a bad row fails in seconds.
    rows = load_jsonl(config.data.path) if config.data.task == "jsonl" else None
    train_samples = None
    if rows is not None:
        # The first num_eval_samples rows are held out for evaluation, the rest is trained on.
        if len(rows) <= config.data.num_eval_samples:
            raise ValueError(
                f"data.path has {len(rows)} rows, not more than data.num_eval_samples "
                f"({config.data.num_eval_samples}) held out for eval; lower it or add rows"
            )
        eval_rows, train_samples = rows[: config.data.num_eval_samples], rows[config.data.num_eval_samples :]
    ctx = build_context(config, rank, dims, device)
    is_rank0 = rank == 0
    eval_samples = eval_rows if rows is not None else ctx.task.samples(
        "eval", config.data.num_eval_samples, config.job.seed)
    if is_rank0:
        n_params = sum(p.numel() for p in ctx.policy.parameters())
        print(f"titanrl | {config.job.description} | {dims.world_size} rank(s) {ctx.dims} | "
              f"model {config.model.flavor} ({n_params / 1e6:.1f}M params local) | task {config.data.task}", flush=True)

    ckpt = CheckpointManager(os.path.join(config.job.dump_folder, config.checkpoint.folder),
                             config.checkpoint.keep_latest_k)
    if config.training.warmup_sft_steps and not resuming(config):
        before = evaluate(ctx, eval_samples)["eval_accuracy"]
        ctx.metrics.log(-config.training.warmup_sft_steps, {"phase": "sft", "eval_accuracy_before_sft": before})
        sft_warmup(ctx, train_samples)
    if config.algorithm.kl_coef > 0 or config.critic.enable:
        # The reference (and the critic's trunk) is the policy as RL starts (after the warm-up),
        # sharded the same way; on resume their weights come from the checkpoint.
        full = get_model_state_dict(ctx.policy, options=StateDictOptions(full_state_dict=True))
    if config.algorithm.kl_coef > 0:
        ctx.reference = build_model(
            ctx.policy.args, ctx.dims, config, ctx.device, full_state_dict=full
        ).requires_grad_(False)
    if config.critic.enable:
        ctx.critic = build_critic(ctx.policy, full, ctx.dims, config, ctx.device)
        ctx.critic_optimizer = build_optimizer(ctx.critic, dataclasses.replace(config.optimizer, lr=config.critic.lr))

    optimizer = build_optimizer(ctx.policy, config.optimizer)
    scheduler = build_lr_scheduler(optimizer, config.training.steps, config.lr_scheduler)
    stream = DatasetStream(train_samples, config.job.seed) if train_samples else TaskStream(ctx.task, config.job.seed)
    prompt_loader = build_prompt_loader(stream, config.training.batch_size, ctx.dims.dp_rank, ctx.dims.dp_size)
    models = {"model": ctx.policy, **({"reference": ctx.reference} if ctx.reference is not None else {})}
    optimizers = {"model": optimizer}
    if ctx.critic is not None:
        models["critic"] = ctx.critic
        optimizers["critic"] = ctx.critic_optimizer

    start_step = 1
    restored = None
    if config.checkpoint.load_path:
        path = config.checkpoint.load_path.rstrip("/")
        match = re.fullmatch(r"step-(\d+)", os.path.basename(path))
        if not match or not os.path.exists(os.path.join(path, ".metadata")):
            raise ValueError(f"checkpoint.load_path '{path}' is not a complete titanrl step-N checkpoint folder")
        restored = int(match.group(1)), ckpt.load(path, models, optimizers)
    elif resuming(config):
        restored = ckpt.load_latest(models, optimizers, log=print if is_rank0 else lambda _: None)
    if restored is not None:
        step, host = restored
        scheduler.load_state_dict(host["scheduler"])
        prompt_loader.load_state_dict(host["loader"])
        torch.set_rng_state(host["torch_rng"])
        random.setstate(host["py_rng"])
        first_eval, last_eval = host["first_eval"], host["last_eval"]
        start_step = step + 1
        if is_rank0:
            print(f"resumed from {config.checkpoint.load_path or ckpt.step_dir(step)} (step {step})", flush=True)
    else:
        last_eval = evaluate(ctx, eval_samples)
        ctx.metrics.log(0, {"phase": "rl", **last_eval}, {"eval_accuracy": "EVAL_ACC"})
        first_eval = last_eval["eval_accuracy"]
    loader = iter(prompt_loader)

    for step in range(start_step, config.training.steps + 1):
        metrics = rl_step(ctx, loader, step, optimizer, scheduler)
        fault_point("step", step)
        if config.metrics.eval_freq and step % config.metrics.eval_freq == 0 or step == config.training.steps:
            last_eval = evaluate(ctx, eval_samples)
            metrics.update(last_eval)
        if step % config.metrics.log_freq == 0 or "eval_accuracy" in metrics:
            ctx.metrics.log(step, {"phase": "rl", **metrics}, CONSOLE)
        if config.checkpoint.enable and (step % config.checkpoint.interval == 0 or step == config.training.steps):
            host = {
                "step": step, "scheduler": scheduler.state_dict(), "loader": prompt_loader.state_dict(),
                "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                "first_eval": first_eval, "last_eval": last_eval,
            }
            with ctx.watchdog.phase("checkpoint"):
                ckpt.save(step, models, optimizers, host)
    if config.checkpoint.export_hf:
        export_hf(ctx.policy, os.path.join(config.job.dump_folder, "hf"))
    if is_rank0:
        print(f"eval accuracy: {first_eval:.3f} -> {last_eval['eval_accuracy']:.3f}", flush=True)
    ctx.rewards.close()
    if ctx.envs is not None:
        ctx.envs.close()
    ctx.metrics.close()
    launch.shutdown()
    return {"first_eval_accuracy": first_eval, **last_eval}


if __name__ == "__main__":
    launch.run(main)

"""The titanrl controller: every rank runs this file under torchrun.

    torchrun --nproc_per_node=N -m titanrl.train --job.config_file train_configs/X.toml [--section.key=value]

One RL step, top to bottom in `rl_step`:
  prompts -> sync weights into the generator -> generate G samples per prompt -> free the KV
  pool -> rewards -> (reference / old logprobs) -> group advantages -> policy update in
  mini-batches and micro-batches -> metrics.
"""

import contextlib
import importlib
import os
import random
import re
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanrl.algorithms.common import entropy_from_logits, kl_estimate
from titanrl.algorithms.grpo import group_advantages, grpo_loss
from titanrl.components.checkpoint import CheckpointManager, fault_active, fault_point
from titanrl.components.loss import global_token_count, sft_loss, token_logprobs
from titanrl.components.metrics import MetricsLogger
from titanrl.components.model_builder import build_model
from titanrl.components.optimizer import build_lr_scheduler, build_optimizer
from titanrl.components.watchdog import Watchdog
from titanrl.config import JobConfig, help_text, load_config, to_toml
from titanrl.config.job_config import Optimizer as OptimizerConfig
from titanrl.data.batch import build_sequence_batch, micro_batches, num_micro_batches, split_batch
from titanrl.data.prompts import DatasetStream, TaskStream, build_prompt_loader, load_jsonl
from titanrl.distributed import ParallelDims, clip_grad_norm_, device_type, init_distributed, set_determinism
from titanrl.envs.tasks import NumericMath, Sample, Task, build_task
from titanrl.generator import Generator, GeneratorOptions, SamplingParams
from titanrl.models.batch_invariant import ExactCausalAttention, batch_invariant_mode
from titanrl.models.flavors import get_model_args
from titanrl.models.hf import export_hf, read_hf_config
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer, build_tokenizer
from titanrl.rewards.runner import RewardItem, RewardRunner

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


class PhaseTimer:
    """Times each phase of a step, under the watchdog."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        with self.watchdog.phase(phase):
            yield
        self.seconds[phase] += time.perf_counter() - start


def _dp_all_reduce(values: list[float], ctx: Context, op: dist.ReduceOp) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if ctx.dp_group is not None:
        dist.all_reduce(t, op=op, group=ctx.dp_group)
    return t.tolist()


def dp_sum(values: list[float], ctx: Context) -> list[float]:
    """Sum each value over data-parallel ranks (TP peers hold equal copies and are not counted)."""
    return _dp_all_reduce(values, ctx, dist.ReduceOp.SUM)


def dp_max(values: list[float], ctx: Context) -> list[float]:
    return _dp_all_reduce(values, ctx, dist.ReduceOp.MAX)


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
        answers = [ctx.tokenizer.encode(s.solution) + [eos] for s in samples]
        batch = build_sequence_batch(prompts, answers, ctx.tokenizer.pad_id).to(ctx.device)
        num_tokens = global_token_count(batch["loss_mask"], ctx.dp_group)
        opt.zero_grad()
        tokens_BT = batch["tokens"]
        loss = sft_loss(ctx.policy(tokens_BT[:, :-1]), tokens_BT[:, 1:], batch["loss_mask"], num_tokens)
        loss.backward()
        clip_grad_norm_(list(ctx.policy.parameters()), cfg.max_norm)
        opt.step()
        if step % 25 == 0 or step == cfg.warmup_sft_steps:
            (global_loss,) = dp_sum([loss.item()], ctx)
            ctx.metrics.log(step - cfg.warmup_sft_steps, {"phase": "sft", "sft_loss": global_loss})


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
    completions, _ = ctx.generator.generate([encode_prompt(ctx, s) for s in mine], params)
    ctx.generator.sleep()
    results = ctx.rewards([RewardItem(s.prompt, c.text, s.answer, s.metadata) for s, c in zip(mine, completions)])
    correct, total = dp_sum([sum(r.correct for r in results), len(results)], ctx)
    return {"eval_accuracy": correct / max(total, 1.0), "eval_samples": total}


# ---- one RL step ----

def rl_step(ctx: Context, samples: list[Sample], step: int, optimizer, scheduler) -> dict[str, float]:
    cfg, algo = ctx.config, ctx.config.algorithm
    timer = PhaseTimer(ctx.watchdog)
    G = algo.group_size

    # 1. Generate G samples per prompt with the current policy weights.
    with timer("sync"):
        ctx.generator.wake()
        ctx.generator.load_weights(ctx.policy)
    prompts = [encode_prompt(ctx, s) for s in samples]
    params = SamplingParams(
        max_new_tokens=cfg.generator.max_new_tokens, temperature=cfg.generator.temperature,
        top_p=cfg.generator.top_p, top_k=cfg.generator.top_k, n=G, seed=hash((cfg.job.seed, step)) & 0x7FFF_FFFF,
    )
    # Global prompt ids (the loader shards strided) seed each sample: same samples on any layout.
    prompt_ids = [i * ctx.dims.dp_size + ctx.dims.dp_rank for i in range(len(prompts))]
    with timer("generate"):
        if fault_active("hang_generate", step):
            time.sleep(3600)
        completions, gen_stats = ctx.generator.generate(prompts, params, prompt_ids)
    ctx.generator.sleep()  # the KV pool's memory goes to training

    # 2. Rewards, isolated in worker processes.
    with timer("reward"):
        results = ctx.rewards([
            RewardItem(samples[c.prompt_index].prompt, c.text, samples[c.prompt_index].answer,
                       samples[c.prompt_index].metadata)
            for c in completions
        ])
    rewards_N = torch.tensor([r.reward for r in results])

    batch = build_sequence_batch(
        [prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
        ctx.tokenizer.pad_id, [c.logprobs for c in completions],
    ).to(ctx.device)
    mask = batch["loss_mask"]

    # 3. Reference logprobs (for the KL term) and old logprobs (only when updates go off-policy).
    off_policy = algo.ppo_epochs * algo.num_minibatches > 1
    with timer("logprob"), torch.no_grad():
        if algo.kl_coef > 0:
            batch["ref_logprobs"], _ = forward_logprobs(ctx.reference, batch, cfg.generator.batch_invariant)
        if off_policy:
            batch["old_logprobs"], _ = forward_logprobs(ctx.policy, batch, cfg.generator.batch_invariant)
    shaped_N = rewards_N
    if algo.kl_coef > 0 and algo.kl_in_reward:
        seq_kl = (kl_estimate(batch["gen_logprobs"], batch["ref_logprobs"], algo.kl_estimator) * mask).sum(-1)
        shaped_N = rewards_N - algo.kl_coef * seq_kl.cpu()

    # 4. Group-relative advantages (all G samples of a prompt live on this rank).
    batch["advantages"] = group_advantages(shaped_N, G, algo.normalize_std).to(ctx.device)

    # 5. Policy update: epochs x mini-batches of optimizer steps, micro-batches accumulate.
    sums = defaultdict(float)
    grad_norms = []
    with timer("train"):
        for _ in range(algo.ppo_epochs):
            for minibatch in split_batch(batch, algo.num_minibatches):
                grad_norms.append(update(ctx, minibatch, optimizer, off_policy, sums, step))
        scheduler.step()

    # 6. Metrics, summed over data-parallel ranks.
    n_tok = mask.sum().item()
    totals = dp_sum([
        rewards_N.sum().item(), (rewards_N**2).sum().item(), sum(r.correct for r in results), len(results),
        n_tok, sum(r.failed is not None for r in results), sums["kl"], sums["entropy"], sums["clipped"],
        sums["tokens"], sums["gen_diff"], gen_stats.decode_tokens + gen_stats.prefill_tokens,
    ], ctx)
    (r_sum, r_sq, n_correct, n, toks, failed, kl, ent, clipped, upd_tokens, gen_diff, gen_tokens) = totals
    r_mean = r_sum / n
    step_time = sum(timer.seconds.values())
    metrics = {
        "reward_mean": r_mean,
        "reward_std": max(r_sq / n - r_mean**2, 0.0) ** 0.5,
        "accuracy": n_correct / n,
        "response_len": toks / n,
        "reward_failures": failed,
        "kl": kl / max(upd_tokens, 1.0),
        "entropy": ent / max(upd_tokens, 1.0),
        "clip_frac": clipped / max(upd_tokens, 1.0),
        "ratio_max": sums["ratio_max"],
        # |trainer - generator| logprob of the sampled tokens: 0 only in batch-invariant mode.
        "gen_logprob_diff": gen_diff / max(upd_tokens, 1.0),
        "grad_norm": max(grad_norms, key=lambda g: g if g == g else float("-inf")),
        "skipped_updates": sums["skipped_updates"],
        "lr": scheduler.get_last_lr()[0],
        "tokens_per_s": gen_tokens / max(step_time, 1e-9),
        **{f"time_{k}": v for k, v in timer.seconds.items()},
        "peak_mem_gb": peak_memory_gb(ctx.device),
    }
    return metrics


def update(ctx: Context, minibatch: TensorDict, optimizer, off_policy: bool, sums: dict, step: int) -> float:
    """One optimizer step over `minibatch`, accumulated over micro-batches; returns the grad norm."""
    algo, cfg = ctx.config.algorithm, ctx.config
    num_tokens = global_token_count(minibatch["loss_mask"], ctx.dp_group).item()
    (num_seqs,) = dp_sum([float(minibatch.batch_size[0])], ctx)
    # FSDP needs the same number of forward/backward passes on every dp rank: take the max.
    (n_micro,) = dp_max([num_micro_batches(minibatch, cfg.training.micro_batch_tokens)], ctx)
    optimizer.zero_grad()
    for mb in micro_batches(minibatch, int(min(n_micro, minibatch.batch_size[0]))):
        logprobs, logits = forward_logprobs(ctx.policy, mb, cfg.generator.batch_invariant)
        mask = mb["loss_mask"]
        # On-policy with a single update: pi_old is this very forward, so the ratio is exactly 1.
        old = mb["old_logprobs"] if off_policy else logprobs.detach()
        out = grpo_loss(
            logprobs, old, mb["advantages"], mask,
            clip_low=algo.clip_eps_low, clip_high=algo.clip_eps_high, loss_agg=algo.loss_agg,
            num_global_tokens=num_tokens, num_global_seqs=num_seqs,
            ref_logprobs_BT=mb["ref_logprobs"] if algo.kl_coef > 0 and not algo.kl_in_reward else None,
            kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_estimator=algo.kl_estimator,
        )
        loss = out.loss * float("nan") if fault_active("nan_loss", step) else out.loss
        loss.backward()
        with torch.no_grad():
            if algo.kl_coef > 0:
                sums["kl"] += (kl_estimate(logprobs, mb["ref_logprobs"], algo.kl_estimator) * mask).sum().item()
            sums["entropy"] += (entropy_from_logits(logits) * mask).sum().item()
            sums["clipped"] += out.clipped_tokens.item()
            sums["tokens"] += mask.sum().item()
            sums["gen_diff"] += ((logprobs - mb["gen_logprobs"]).abs() * mask).sum().item()
            sums["ratio_max"] = max(sums["ratio_max"], out.ratio_max.item())
    grad_norm = clip_grad_norm_(list(ctx.policy.parameters()), cfg.training.max_norm)
    # The norm is global (all ranks agree), so every rank takes the same branch.
    if not torch.isfinite(grad_norm):
        if cfg.training.on_nonfinite == "stop":
            raise FloatingPointError(
                "non-finite gradient norm in the policy update (loss or logprobs overflowed); "
                "lower optimizer.lr, check rewards, or set training.on_nonfinite = 'skip'"
            )
        optimizer.zero_grad()
        sums["skipped_updates"] += 1
        return float("nan")
    optimizer.step()
    return grad_norm.item()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---- set-up ----

def resuming(config: JobConfig) -> bool:
    folder = os.path.join(config.job.dump_folder, config.checkpoint.folder)
    has_latest = bool(CheckpointManager(folder, 0).complete_steps())
    return config.checkpoint.enable and (bool(config.checkpoint.load_path) or has_latest)


def build_context(config: JobConfig, rank: int, world_size: int) -> Context:
    dims = ParallelDims(config.parallelism.dp_replicate, config.parallelism.dp_shard, config.parallelism.tp, world_size)
    device = torch.device(device_type(), int(os.environ.get("LOCAL_RANK", 0)) if device_type() == "cuda" else None)
    tokenizer = build_tokenizer(config.model.tokenizer)
    if config.model.hf_checkpoint:
        model_args = read_hf_config(config.model.hf_checkpoint)
    else:
        model_args = get_model_args(config.model.flavor)
    if config.model.max_seq_len:
        model_args.max_seq_len = config.model.max_seq_len
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but model vocab_size is {model_args.vocab_size}; "
            "pick a matching model.flavor / model.tokenizer"
        )
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
    return Context(
        config=config, dims=dims, device=device, tokenizer=tokenizer, task=task, policy=policy, reference=None,
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
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return {}
    config = load_config(argv)
    rank, world_size = init_distributed()
    set_determinism(config.job.seed, config.job.deterministic)
    if rank == 0 and config.job.print_config:
        print(to_toml(config))
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
    ctx = build_context(config, rank, world_size)
    is_rank0 = rank == 0
    eval_samples = eval_rows if rows is not None else ctx.task.samples(
        "eval", config.data.num_eval_samples, config.job.seed)
    if is_rank0:
        n_params = sum(p.numel() for p in ctx.policy.parameters())
        print(f"titanrl | {config.job.description} | {world_size} rank(s) {ctx.dims} | "
              f"model {config.model.flavor} ({n_params / 1e6:.1f}M params local) | task {config.data.task}", flush=True)

    ckpt = CheckpointManager(os.path.join(config.job.dump_folder, config.checkpoint.folder),
                             config.checkpoint.keep_latest_k)
    if config.training.warmup_sft_steps and not resuming(config):
        before = evaluate(ctx, eval_samples)["eval_accuracy"]
        ctx.metrics.log(-config.training.warmup_sft_steps, {"phase": "sft", "eval_accuracy_before_sft": before})
        sft_warmup(ctx, train_samples)
    if config.algorithm.kl_coef > 0:
        # The reference is the policy as RL starts (after the warm-up), sharded the same way;
        # on resume its weights come from the checkpoint.
        full = get_model_state_dict(ctx.policy, options=StateDictOptions(full_state_dict=True))
        ctx.reference = build_model(
            ctx.policy.args, ctx.dims, config, ctx.device, full_state_dict=full
        ).requires_grad_(False)

    optimizer = build_optimizer(ctx.policy, config.optimizer)
    scheduler = build_lr_scheduler(optimizer, config.training.steps, config.lr_scheduler)
    stream = DatasetStream(train_samples, config.job.seed) if train_samples else TaskStream(ctx.task, config.job.seed)
    prompt_loader = build_prompt_loader(stream, config.training.batch_size, ctx.dims.dp_rank, ctx.dims.dp_size)
    models = {"model": ctx.policy, **({"reference": ctx.reference} if ctx.reference is not None else {})}

    start_step = 1
    restored = None
    if config.checkpoint.load_path:
        path = config.checkpoint.load_path.rstrip("/")
        match = re.fullmatch(r"step-(\d+)", os.path.basename(path))
        if not match or not os.path.exists(os.path.join(path, ".metadata")):
            raise ValueError(f"checkpoint.load_path '{path}' is not a complete titanrl step-N checkpoint folder")
        restored = int(match.group(1)), ckpt.load(path, models, optimizer)
    elif resuming(config):
        restored = ckpt.load_latest(models, optimizer, log=print if is_rank0 else lambda _: None)
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
        metrics = rl_step(ctx, next(loader), step, optimizer, scheduler)
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
                ckpt.save(step, models, optimizer, host)
    if config.checkpoint.export_hf:
        export_hf(ctx.policy, os.path.join(config.job.dump_folder, "hf"))
    if is_rank0:
        print(f"eval accuracy: {first_eval:.3f} -> {last_eval['eval_accuracy']:.3f}", flush=True)
    ctx.rewards.close()
    ctx.metrics.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"first_eval_accuracy": first_eval, **last_eval}


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        # A user error (config, data, degrees): the message names the cause and the fix.
        print(f"titanrl: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)

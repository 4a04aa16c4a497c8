"""Offline recipes beside RL: SFT, DPO and reward-model training, on the same model builder,
parallelism, optimizer, data loader, checkpoints and metrics as `titanrl.train`.

    torchrun --nproc_per_node=N -m titanrl.train_offline --job.config_file train_configs/dpo_reverse_debug.toml

`offline.recipe` picks the loss:
  sft           -log p(completion | prompt), token mean over the global batch
  dpo           DPO against a frozen copy of the starting policy (`algorithms/dpo.py`)
  reward_model  Bradley-Terry on a one-label score head (usable as RL's `reward.model_path`)
Data: `data.task = "jsonl"` reads `data.path` ({prompt, answer[, solution]} rows for sft,
{prompt, chosen, rejected} for dpo / reward_model; the first data.num_eval_samples rows are
held out), or an embedded task gives SFT samples / synthetic preference pairs. The result goes
to <dump_folder>/hf with `checkpoint.export_hf`, ready for `model.hf_checkpoint` (SFT, DPO) or
`reward.model_path` (reward model).
"""

import dataclasses
import os
import random

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanrl.algorithms.dpo import bradley_terry_loss, dpo_loss
from titanrl.components.checkpoint import CheckpointManager
from titanrl.components import launch
from titanrl.components.loss import sft_loss, token_logprobs
from titanrl.components.metrics import MetricsLogger
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.components.optimizer import build_lr_scheduler, build_optimizer
from titanrl.config import JobConfig
from titanrl.data.batch import build_sequence_batch, num_micro_batches
from titanrl.data.preferences import load_preferences, synthetic_preferences
from titanrl.data.prompts import DatasetStream, build_prompt_loader, load_jsonl
from titanrl.distributed import ParallelDims, all_reduce_values, clip_grad_norm_
from titanrl.envs.tasks import build_task
from titanrl.models.hf import export_hf, from_hf_state_dict, load_safetensors_folder
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer, build_tokenizer

CONSOLE = {"loss": "loss", "grad_norm": "gnorm", "lr": "lr", "margin": "margin", "pref_accuracy": "pref_acc",
           "eval_loss": "EVAL_LOSS", "eval_pref_accuracy": "EVAL_PREF_ACC", "eval_margin": "EVAL_MARGIN"}


def load_rows(config: JobConfig) -> tuple[list, list]:
    """(train rows, held-out eval rows): Samples for sft, PreferencePairs otherwise."""
    n_eval, recipe = config.data.num_eval_samples, config.offline.recipe
    if config.data.task == "jsonl":
        rows = load_jsonl(config.data.path) if recipe == "sft" else load_preferences(config.data.path)
        if len(rows) <= n_eval:
            raise ValueError(f"data.path has {len(rows)} rows, not more than data.num_eval_samples ({n_eval})")
        return rows[n_eval:], rows[:n_eval]
    task = build_task(config.data.task)
    n_train = config.training.steps * config.training.batch_size
    if recipe == "sft":
        return task.samples("train", n_train, config.job.seed), task.samples("eval", n_eval, config.job.seed)
    return (synthetic_preferences(task, "train", n_train, config.job.seed),
            synthetic_preferences(task, "eval", n_eval, config.job.seed))


def encode(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(prompt), tokenizer.encode(completion) + [tokenizer.eos_id]


def encode_rows(config: JobConfig, tokenizer: Tokenizer, rows: list) -> list[list[tuple[list[int], list[int]]]]:
    """Each row's sequences as (prompt ids, completion ids): [demonstration] for sft, [chosen,
    rejected] for a preference pair."""
    if config.offline.recipe == "sft":
        return [[encode(tokenizer, s.prompt, s.solution)] for s in rows]
    return [[encode(tokenizer, p.prompt, p.chosen), encode(tokenizer, p.prompt, p.rejected)] for p in rows]


def to_batch(encoded: list[list[tuple[list[int], list[int]]]], pad_id: int, device: torch.device) -> TensorDict:
    """One right-padded batch; pairs put every chosen row first, then the rejected rows."""
    seqs = [row[k] for k in range(len(encoded[0])) for row in encoded]  # column-major: chosen, then rejected
    return build_sequence_batch([q for q, _ in seqs], [c for _, c in seqs], pad_id).to(device)


def micro_batch_rows(config: JobConfig, encoded: list, dp_group) -> list[list]:
    """This rank's encoded rows in micro-batches of about training.micro_batch_tokens padded
    tokens (a pair's two sequences stay together: DPO's loss couples them), sorted by length,
    as many on every dp rank (FSDP runs collectives in every forward and backward)."""
    per_row = 1 if config.offline.recipe == "sft" else 2
    lengths = [max(len(q) + len(c) for q, c in row) for row in encoded]
    budget = config.training.micro_batch_tokens
    needed = num_micro_batches(lengths, max(budget // per_row, 1) if budget else 0)
    n, fewest_rows = all_reduce_values([needed, -len(encoded)], dp_group, op=dist.ReduceOp.MAX)
    n = int(min(n, -fewest_rows))
    if n == 0:  # some rank holds no rows (fewer held-out rows than ranks): nobody runs a forward
        return []
    if n == 1:  # in order: sorting would change the sums' rounding and every seeded run's numbers
        return [encoded]
    order = sorted(range(len(encoded)), key=lambda i: lengths[i])
    bounds = [len(order) * k // n for k in range(n + 1)]
    return [[encoded[i] for i in order[a:b]] for a, b in zip(bounds, bounds[1:])]


def sequence_logprobs(model: Transformer, batch: TensorDict) -> torch.Tensor:
    """Sum of completion-token logprobs per row [B]."""
    tokens_BT = batch["tokens"]
    logprobs_BT = token_logprobs(model(tokens_BT[:, :-1]), tokens_BT[:, 1:])
    return (logprobs_BT * batch["loss_mask"]).sum(-1)


def build_models(config: JobConfig, dims: ParallelDims, device: torch.device,
                 vocab: int) -> tuple[Transformer, Transformer | None]:
    """(trained model, frozen DPO reference or None)."""
    hf = config.model.hf_checkpoint
    args = launch.model_args(config, vocab)
    if config.offline.recipe != "reward_model":
        model = build_model(args, dims, config, device, hf_checkpoint=hf)
        reference = None
        if config.offline.recipe == "dpo":
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            reference = build_model(args, dims, config, device, full_state_dict=full).requires_grad_(False)
        return model, reference
    # Reward model: the LM's trunk (or a fresh init) under a new one-label head.
    rm_args = dataclasses.replace(args, num_labels=1)
    if hf and args.num_labels == 1:
        return build_model(rm_args, dims, config, device, hf_checkpoint=hf), None
    sd = from_hf_state_dict(load_safetensors_folder(hf), args) if hf else init_full_state_dict(rm_args, config.job.seed)
    if args.num_labels != 1:
        sd.pop("output.weight", None)
        sd["output.weight"] = torch.zeros(1, args.dim)
    return build_model(rm_args, dims, config, device, full_state_dict=sd), None


def normaliser(config: JobConfig, batches: list[TensorDict], dp_group) -> float:
    """What the global loss is averaged over: loss tokens (sft) or preference pairs, all ranks."""
    if config.offline.recipe == "sft":
        count = sum(b["loss_mask"].sum().item() for b in batches)
    else:
        count = sum(b.batch_size[0] // 2 for b in batches)
    (total,) = all_reduce_values([count], dp_group)
    return max(total, 1.0)


def batch_loss(config: JobConfig, model: Transformer, reference: Transformer | None, batch: TensorDict,
               norm: float) -> tuple[torch.Tensor, dict]:
    """(this micro-batch's share of the global loss, its summed statistics)."""
    recipe = config.offline.recipe
    if recipe == "sft":
        tokens_BT = batch["tokens"]
        loss = sft_loss(model(tokens_BT[:, :-1]), tokens_BT[:, 1:], batch["loss_mask"], torch.tensor(norm))
        return loss, {"loss": loss.item()}
    margin_B, loss_B = preference_margins(config, model, reference, batch)
    loss = loss_B.sum() / norm
    return loss, {"loss": loss.item() * norm, "margin": margin_B.sum().item(),
                  "pref_accuracy": (margin_B > 0).float().sum().item()}


def preference_margins(config: JobConfig, model: Transformer, reference: Transformer | None,
                       batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen-minus-rejected margin [n], loss [n]) of the n pairs in a chosen-then-rejected batch:
    DPO's implicit reward margin, or the reward model's score margin."""
    n = batch.batch_size[0] // 2
    if config.offline.recipe == "dpo":
        policy_lp = sequence_logprobs(model, batch)
        with torch.no_grad():
            ref_lp = sequence_logprobs(reference, batch)
        out = dpo_loss(policy_lp[:n], policy_lp[n:], ref_lp[:n], ref_lp[n:], config.offline.dpo_beta,
                       config.offline.label_smoothing)
        return (out.chosen_reward_B - out.rejected_reward_B).detach(), out.loss_B
    scores_BT = model(batch["tokens"])[..., 0].float()  # with gradients, unlike sequence_scores
    scores_B = scores_BT.gather(1, (batch["length"] - 1)[:, None]).squeeze(1)
    return (scores_B[:n] - scores_B[n:]).detach(), bradley_terry_loss(scores_B[:n], scores_B[n:])


def accumulate(config: JobConfig, model: Transformer, reference: Transformer | None, batches: list[TensorDict],
               dp_group, backward: bool) -> tuple[dict, float]:
    """Forward (and backward) every micro-batch: (statistics summed over this rank, normaliser)."""
    norm = normaliser(config, batches, dp_group)
    stats: dict[str, float] = {}
    for batch in batches:
        loss, part = batch_loss(config, model, reference, batch, norm)
        if backward:
            loss.backward()
        for k, v in part.items():
            stats[k] = stats.get(k, 0.0) + v
    return stats, norm


@torch.no_grad()
def evaluate(config: JobConfig, tokenizer: Tokenizer, model: Transformer, reference: Transformer | None,
             rows: list, dims: ParallelDims, device: torch.device, dp_group) -> dict[str, float]:
    """Held-out loss (sft) or preference accuracy and margin (dpo, reward_model), over all ranks."""
    encoded = encode_rows(config, tokenizer, rows[dims.dp_rank :: dims.dp_size])
    batches = [to_batch(mb, tokenizer.pad_id, device) for mb in micro_batch_rows(config, encoded, dp_group)]
    stats, norm = accumulate(config, model, reference, batches, dp_group, backward=False)
    keys = sorted(stats)
    totals = dict(zip(keys, all_reduce_values([stats[k] for k in keys], dp_group)))
    if config.offline.recipe == "sft":
        return {"eval_loss": totals["loss"]}
    return {"eval_margin": totals["margin"] / norm, "eval_pref_accuracy": totals["pref_accuracy"] / norm}


def main(argv: list[str] | None = None) -> dict[str, float]:
    config = launch.parse_args(argv)
    if config is None:
        return {}
    train_rows, eval_rows = load_rows(config)  # bad data fails before anything is built
    rank, dims, device = launch.start(config)
    cfg = config.training
    dp_group = dims.dp_mesh.get_group() if dims.dp_size > 1 else None
    tokenizer = build_tokenizer(config.model.tokenizer)
    model, reference = build_models(config, dims, device, tokenizer.vocab_size)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.steps, config.lr_scheduler)
    loader = build_prompt_loader(DatasetStream(train_rows, config.job.seed), cfg.batch_size, dims.dp_rank, dims.dp_size)
    ckpt = CheckpointManager(os.path.join(config.job.dump_folder, config.checkpoint.folder),
                             config.checkpoint.keep_latest_k)
    models = {"model": model, **({"reference": reference} if reference is not None else {})}
    start = 1
    restored = ckpt.load_latest(models, {"model": optimizer}) if config.checkpoint.enable else None
    metrics = MetricsLogger(config, rank, append=restored is not None)
    if restored is not None:
        step, host = restored
        scheduler.load_state_dict(host["scheduler"])
        loader.load_state_dict(host["loader"])
        torch.set_rng_state(host["torch_rng"])
        random.setstate(host["py_rng"])
        start = step + 1
    first_eval = evaluate(config, tokenizer, model, reference, eval_rows, dims, device, dp_group)
    if restored is None:
        metrics.log(0, {"phase": config.offline.recipe, **first_eval}, CONSOLE)
    batches = iter(loader)
    last_eval = first_eval
    for step in range(start, cfg.steps + 1):
        encoded = encode_rows(config, tokenizer, next(batches))
        micro = [to_batch(mb, tokenizer.pad_id, device) for mb in micro_batch_rows(config, encoded, dp_group)]
        optimizer.zero_grad()
        stats, norm = accumulate(config, model, reference, micro, dp_group, backward=True)
        grad_norm = clip_grad_norm_(list(model.parameters()), cfg.max_norm)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError("non-finite gradient norm; lower optimizer.lr or check the data")
        optimizer.step()
        scheduler.step()
        keys = sorted(stats)
        totals = dict(zip(keys, all_reduce_values([stats[k] for k in keys], dp_group)))
        if config.offline.recipe != "sft":
            totals = {k: v / norm for k, v in totals.items()}
        out = {"phase": config.offline.recipe, **totals, "grad_norm": grad_norm.item(),
               "lr": scheduler.get_last_lr()[0], "micro_batches": len(micro)}
        if step % config.offline.eval_freq == 0 or step == cfg.steps:
            last_eval = evaluate(config, tokenizer, model, reference, eval_rows, dims, device, dp_group)
            out.update(last_eval)
        if step % config.metrics.log_freq == 0 or step == cfg.steps:
            metrics.log(step, out, CONSOLE)
        if config.checkpoint.enable and (step % config.checkpoint.interval == 0 or step == cfg.steps):
            host = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                    "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}
            ckpt.save(step, models, {"model": optimizer}, host)
    if config.checkpoint.export_hf:
        export_hf(model, os.path.join(config.job.dump_folder, "hf"))
    if rank == 0:
        summary = ", ".join(f"{k} {first_eval[k]:.4f} -> {last_eval[k]:.4f}" for k in sorted(last_eval))
        print(f"{config.offline.recipe}: {summary}", flush=True)
    metrics.close()
    launch.shutdown()
    return {**{f"first_{k}": v for k, v in first_eval.items()}, **last_eval}


if __name__ == "__main__":
    launch.run(main)

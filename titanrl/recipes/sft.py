"""SFT: -log p(demonstration | prompt), token mean over the global batch.

    python -m titanrl.train --job.config_file train_configs/sft_reverse_debug.toml

Data: `data.path` reads {prompt, answer[, solution]} rows from data.path (the first
data.num_eval_samples rows are held out), or an embedded task gives worked solutions. The same
step is the RL recipe's supervised warm-up (`warmup`, configured by [sft_warmup]).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from titanrl.components.loss import global_token_count, sft_loss
from titanrl.components.optimizer import build_optimizer
from titanrl.components.timer import phase
from titanrl.config import JobConfig
from titanrl.config.training import Optimizer as OptimizerConfig
from titanrl.data.batch import build_sequence_batch
from titanrl.data.batch_forward import forward_logprobs
from titanrl.data.encode import fit_demonstrations
from titanrl.data.loader import load_data
from titanrl.data.prompts import DatasetStream, build_prompt_loader, prompt_stream
from titanrl.data.tasks import Sample, Task
from titanrl.envs.builtin import ALL_TASKS
from titanrl.models.model import Transformer
from titanrl.recipes.base import Recipe

if TYPE_CHECKING:
    from titanrl.trainer import Trainer


def demonstration(trainer: Trainer, sample: Sample) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, completion loss mask) of a sample's worked solution + eos; a
    multi-turn demonstration (metadata 'demo' = [[text, from_model], ...]) masks out the
    environment's text; with a chat template, a demonstrated episode (metadata 'demo_messages':
    the messages after the prompt's) is rendered by the template, only its assistant turns trained."""
    if sample.metadata.get("demo_messages") and trainer.encode_prompt.template is not None:
        return _chat_demonstration(trainer, sample)
    demo = sample.metadata.get("demo") or [[sample.solution, True]]
    tokenizer = trainer.tokenizer
    tokens, mask = [], []
    for text, from_model in demo:
        ids = tokenizer.encode(text)
        tokens += ids
        mask += [int(bool(from_model))] * len(ids)
    return trainer.encode_prompt(sample.prompt, sample.metadata), tokens + [tokenizer.eos_id], mask + [1]


def _chat_demonstration(trainer: Trainer, sample: Sample) -> tuple[list[int], list[int], list[int]]:
    """A demonstrated chat episode: the prompt's messages and 'demo_messages' rendered whole, the
    loss on the assistant's turns (`ChatTemplate.assistant_mask`: their content and end of turn)."""
    encode = trainer.encode_prompt
    assert encode.template is not None, "a chat demonstration needs the chat template"
    prompt = encode(sample.prompt, sample.metadata)
    messages = encode.messages(sample.prompt, sample.metadata) + list(sample.metadata["demo_messages"])
    ids, mask = encode.template.assistant_mask(trainer.tokenizer, messages)
    if ids[: len(prompt)] != prompt:
        raise ValueError(
            "a 'demo_messages' demonstration does not start with its prompt's tokens: the chat template "
            "renders the prompt's messages differently inside the whole conversation"
        )
    return prompt, ids[len(prompt) :], mask[len(prompt) :]


def sft_losses(
    trainer: Trainer, model: Transformer, samples: list[Sample], step: int, train: bool
) -> tuple[float, int]:
    """Forward (and, when `train`, backward) this rank's samples in micro-batches: (this rank's
    share of the global token-mean loss, number of micro-batches)."""
    rows = [demonstration(trainer, s) for s in samples]
    micros = []
    for idx in trainer.plan_micro_batches([len(p) + len(c) for p, c, _ in rows]):
        part = [rows[i] for i in idx.tolist()]
        micros.append(
            build_sequence_batch(
                [p for p, _, _ in part],
                [c for _, c, _ in part],
                trainer.tokenizer.pad_id,
                None,
                [m for _, _, m in part],
            ).to(trainer.device)
        )
    num_tokens = global_token_count(sum((mb["loss_mask"].sum() for mb in micros), torch.tensor(0.0)), trainer.dp_group)
    total = 0.0
    for mb in micros:
        with torch.set_grad_enabled(train):
            # Padded rows; under context parallelism each cp rank runs its sequence shard.
            logprobs_BT, _ = forward_logprobs(model, mb, False, trainer.config.training.logprob_chunk_tokens)
            loss = sft_loss(logprobs_BT, mb["loss_mask"], num_tokens)
        if train:
            trainer.backward(loss, step)
        total += loss.item()
    return total, len(micros)


def sft_step(
    trainer: Trainer, model: Transformer, optimizer: torch.optim.Optimizer, samples: list[Sample], step: int
) -> dict[str, float]:
    """One optimizer step on `samples` (this rank's share of the global batch)."""
    optimizer.zero_grad()
    with phase(trainer.watchdog, "train"):
        local_loss, n_micro = sft_losses(trainer, model, samples, step, train=True)
        grad_norm = trainer.optimizer_step(model, optimizer, "sft")
    (loss,) = trainer.dp_sum([local_loss])
    return {"loss": loss, "grad_norm": grad_norm, "micro_batches": n_micro}


def warmup(trainer: Trainer, task: Task, train_samples: list[Sample] | None) -> None:
    """RL's supervised warm-up ([sft_warmup]): SFT steps on worked solutions (the data's
    'solution' field, else its answer, or the task's), with their own optimizer, so that a
    from-scratch model can start RL. Logged at steps -N .. 0 with phase 'sft'."""
    cfg, config = trainer.config.sft_warmup, trainer.config
    optimizer = build_optimizer(
        trainer.model, OptimizerConfig(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay)
    )
    seed = config.job.seed + cfg.seed_offset
    batches = iter(
        build_prompt_loader(
            prompt_stream(train_samples, task, seed), cfg.batch_size, trainer.dims.dp_rank, trainer.dims.dp_size
        )
    )
    for step in range(1, cfg.steps + 1):
        out = sft_step(trainer, trainer.model, optimizer, next(batches), step - cfg.steps)
        if step % 25 == 0 or step == cfg.steps:
            trainer.metrics.log(
                step - cfg.steps, {"phase": "sft", "sft_loss": out["loss"], "sft_micro_batches": out["micro_batches"]}
            )


class SFTRecipe(Recipe):
    name = "sft"
    console = {"loss": "loss", "grad_norm": "gnorm", "lr": "lr", "eval_loss": "EVAL_LOSS", "eta_s": "eta"}

    @classmethod
    def load_data(cls, config: JobConfig) -> tuple[list[Sample], list[Sample]]:
        split = load_data(config, "demonstrations", ALL_TASKS)
        assert split.train is not None, "demonstrations are rows, never a stream"
        return split.train, split.held_out

    def __init__(self, trainer: Trainer, data: tuple[list[Sample], list[Sample]]) -> None:
        super().__init__(trainer, data)
        train_rows, self.eval_rows = data
        train_rows, self.eval_rows = fit_demonstrations(
            self.config, trainer.model_args.max_seq_len, trainer.encode_prompt, train_rows, self.eval_rows
        )
        dims = trainer.dims
        stream = DatasetStream(train_rows, self.config.job.seed)
        self.loader = build_prompt_loader(stream, self.config.training.batch_size, dims.dp_rank, dims.dp_size)

    def step(self, batches: Iterator, step: int) -> dict[str, float]:
        out = sft_step(self.trainer, self.trainer.model, self.trainer.optimizer, next(batches), step)
        self.trainer.lr_scheduler.step()
        return {**out, "lr": float(self.trainer.lr_scheduler.get_last_lr()[0])}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        dims = self.trainer.dims
        local, _ = sft_losses(
            self.trainer, self.trainer.model, self.eval_rows[dims.dp_rank :: dims.dp_size], 0, train=False
        )
        (total,) = self.trainer.dp_sum([local])
        return {"eval_loss": total}

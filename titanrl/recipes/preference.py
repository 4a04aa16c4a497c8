"""What DPO and reward-model training share: preference pairs, batched chosen-then-rejected.

Data: `data.path` reads {prompt, chosen, rejected} rows from data.path (the first
data.num_eval_samples rows are held out), or an embedded task gives synthetic pairs (its
solution is chosen, a one-character near miss rejected). A subclass says how a batch of pairs
gives margins and losses (`margins`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from titanrl.components.step_stats import StepStats
from titanrl.components.timer import phase
from titanrl.config import JobConfig
from titanrl.data.batch import build_sequence_batch
from titanrl.data.encode import fit_pairs
from titanrl.data.loader import load_data
from titanrl.data.preferences import PreferencePair
from titanrl.data.prompts import DatasetStream, build_prompt_loader
from titanrl.envs.builtin import ALL_TASKS
from titanrl.recipes.base import Recipe

if TYPE_CHECKING:
    from titanrl.trainer import Trainer


@dataclasses.dataclass
class PreferenceStats(StepStats):
    """Sums over a step's pairs: loss (times the global pair count), margin, correct pairs."""

    loss: float = 0.0
    margin: float = 0.0
    pref_accuracy: float = 0.0


class PreferenceRecipe(Recipe):
    console = {
        "loss": "loss",
        "grad_norm": "gnorm",
        "lr": "lr",
        "margin": "margin",
        "pref_accuracy": "pref_acc",
        "eval_pref_accuracy": "EVAL_PREF_ACC",
        "eval_margin": "EVAL_MARGIN",
        "eta_s": "eta",
    }

    @classmethod
    def load_data(cls, config: JobConfig) -> tuple[list[PreferencePair], list[PreferencePair]]:
        split = load_data(config, "preferences", ALL_TASKS)
        assert split.train is not None, "preference pairs are rows, never a stream"
        return split.train, split.held_out

    def __init__(self, trainer: Trainer, data: tuple[list[PreferencePair], list[PreferencePair]]) -> None:
        super().__init__(trainer, data)
        train_pairs, self.eval_pairs = data
        train_pairs, self.eval_pairs = fit_pairs(
            self.config, trainer.model_args.max_seq_len, trainer.encode_prompt, train_pairs, self.eval_pairs
        )
        dims = trainer.dims
        stream = DatasetStream(train_pairs, self.config.job.seed)
        self.loader = build_prompt_loader(stream, self.config.training.batch_size, dims.dp_rank, dims.dp_size)

    def margins(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen-minus-rejected margin [n], loss [n]) of the n pairs of a chosen-then-rejected batch."""
        raise NotImplementedError

    def step(self, batches: Iterator, step: int) -> dict[str, float]:
        trainer = self.trainer
        trainer.optimizer.zero_grad()
        with phase(trainer.watchdog, "train"):
            stats, pairs, n_micro = self.forward(next(batches), step, train=True)
            grad_norm = trainer.optimizer_step(trainer.model, trainer.optimizer, self.name)
        trainer.lr_scheduler.step()
        return {
            **{k: v / pairs for k, v in stats.items()},
            "grad_norm": grad_norm,
            "lr": float(trainer.lr_scheduler.get_last_lr()[0]),
            "micro_batches": n_micro,
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        dims = self.trainer.dims
        stats, pairs, _ = self.forward(self.eval_pairs[dims.dp_rank :: dims.dp_size], 0, train=False)
        return {"eval_margin": stats["margin"] / pairs, "eval_pref_accuracy": stats["pref_accuracy"] / pairs}

    def forward(self, pairs: list[PreferencePair], step: int, train: bool) -> tuple[dict[str, float], float, int]:
        """Forward (and backward) this rank's pairs in micro-batches (a pair's two sequences stay
        in one: the losses couple them): (statistics summed over all ranks, global pair count,
        number of micro-batches)."""
        trainer = self.trainer
        encoded = [
            (trainer.encode_prompt(p.prompt), self._completion(p.chosen), self._completion(p.rejected)) for p in pairs
        ]
        plan = trainer.plan_micro_batches([2 * (len(q) + max(len(c), len(r))) for q, c, r in encoded])
        (num_pairs,) = trainer.dp_sum([float(len(pairs))])
        num_pairs = max(num_pairs, 1.0)
        stats = PreferenceStats()
        for idx in plan:
            part = [encoded[i] for i in idx.tolist()]
            # Column-major: every chosen row first, then the rejected rows.
            prompts = [q for q, _, _ in part] * 2
            completions = [c for _, c, _ in part] + [r for _, _, r in part]
            batch = build_sequence_batch(prompts, completions, trainer.tokenizer.pad_id).to(trainer.device)
            margin_B, loss_B = self.margins(batch)
            loss = loss_B.sum() / num_pairs
            if train:
                trainer.backward(loss, step)
            stats.loss += loss.item() * num_pairs
            stats.margin += margin_B.sum().item()
            stats.pref_accuracy += (margin_B > 0).float().sum().item()
        return dataclasses.asdict(stats.reduced(trainer.dp_group)), num_pairs, len(plan)

    def _completion(self, text: str) -> list[int]:
        return self.trainer.tokenizer.encode(text) + [self.trainer.tokenizer.eos_id]

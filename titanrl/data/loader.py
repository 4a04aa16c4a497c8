"""The one place every recipe gets its data: rows of the user's file when `data.path` is set
(JSONL, Parquet or a Hugging Face datasets folder, by extension), else the embedded task named by
`data.task`. Held-out rows are the file's first `data.num_eval_samples` rows (not trained on), or
the task's eval split (disjoint seeds)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from titanrl.config import JobConfig
from titanrl.data.preferences import load_preferences, synthetic_preferences
from titanrl.data.prompts import held_out_split, samples_from_config
from titanrl.data.task_types import Task
from titanrl.data.tasks import TASKS, NumericMath, build_task

DataKind = Literal["prompts", "demonstrations", "preferences"]


@dataclass
class DataSplit:
    task: Task
    """The verifier of the rows' answers: the embedded task, or numeric answers for a file."""

    train: list[Any] | None
    """Training rows (`Sample`s or `PreferencePair`s); None: the task's endless prompt stream."""

    held_out: list[Any]
    """Rows of the periodic evaluation."""


def load_data(config: JobConfig, kind: DataKind, tasks: dict[str, Callable[[], Task]] = TASKS) -> DataSplit:
    """`kind`: 'prompts' (RL: an embedded task's training prompts are an endless stream),
    'demonstrations' (SFT: prompts with worked solutions), 'preferences' (DPO and reward models:
    chosen / rejected pairs). `tasks` is the registry `data.task` is looked up in."""
    data, n_eval, seed = config.data, config.data.num_eval_samples, config.job.seed
    if data.path:
        rows = load_preferences(data.path, data.allow_changed) if kind == "preferences" else samples_from_config(data)
        train, held_out = held_out_split(rows, n_eval)
        return DataSplit(NumericMath(), train, held_out)
    task = build_task(data.task, tasks)
    n_train = config.training.steps * config.training.batch_size
    if kind == "prompts":
        return DataSplit(task, None, task.samples("eval", n_eval, seed))
    if kind == "demonstrations":
        return DataSplit(task, task.samples("train", n_train, seed), task.samples("eval", n_eval, seed))
    return DataSplit(
        task, synthetic_preferences(task, "train", n_train, seed), synthetic_preferences(task, "eval", n_eval, seed)
    )

"""Prompt data: files of prompts (`load_samples`, formats in `titanrl.data.formats`), prompt
streams and the per-step prompt loader (torchdata.nodes, checkpointable state).

Every rank iterates the same global stream and keeps its own strided share of each global
batch, so a run on N data-parallel ranks sees exactly the prompts of a 1-rank run.
"""

import os
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

import torchdata.nodes as tn

from titanrl.components.console import get_logger
from titanrl.data.formats import RowSchema, read_jsonl_objects, read_rows  # noqa: F401 (read_jsonl_objects: re-export)
from titanrl.data.provenance import ProvenanceLoader, hashed_rows, new_source, sources_in
from titanrl.data.tasks import Sample, Task

log = get_logger(__name__)

if TYPE_CHECKING:
    from titanrl.config.data import Data


class TaskStream:
    """Endless seeded samples of an embedded task (re-iterable, so its loader state can restore)."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task, self.seed = task, seed

    def __iter__(self) -> Iterator[Sample]:
        rng = random.Random(f"{self.task.name}/train/{self.seed}")
        while True:
            yield self.task.make(rng)


T = TypeVar("T")


class DatasetStream(Generic[T]):
    """A fixed list of samples (`Sample`s, or preference pairs), reshuffled every epoch with a seed."""

    def __init__(self, samples: list[T], seed: int) -> None:
        if not samples:
            raise ValueError("the prompt dataset is empty; check data.path")
        self.samples, self.seed = samples, seed

    def __iter__(self) -> Iterator[T]:
        epoch = 0
        while True:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            for i in order:
                yield self.samples[i]
            epoch += 1


def prompt_stream(samples: list[Sample] | None, task: Task, seed: int) -> TaskStream | DatasetStream:
    """The training prompts: a data set's samples, reshuffled each epoch, else the task's endless stream."""
    return DatasetStream(samples, seed) if samples else TaskStream(task, seed)


def build_prompt_loader(stream, global_batch: int, dp_rank: int, dp_size: int) -> tn.Loader:
    if global_batch % dp_size:
        raise ValueError(
            f"training.batch_size ({global_batch} prompts) must be divisible by the {dp_size} data-parallel ranks"
        )
    node = tn.IterableWrapper(stream)
    node = tn.Batcher(node, batch_size=global_batch)
    node = tn.Mapper(node, lambda batch: batch[dp_rank::dp_size])
    return ProvenanceLoader(node, sources_in(getattr(stream, "samples", [])))


LISTED = 5
"""Rows named in a drop report (the first ones; the count says how many more)."""


def listed(rows: list[tuple[str, int]], unit: str) -> str:
    """'a.jsonl:3 (120 unit), a.jsonl:9 (99 unit) and 4 more': the first `LISTED` of (where, size)."""
    text = ", ".join(f"{where} ({size} {unit})" for where, size in rows[:LISTED])
    return text + (f" and {len(rows) - LISTED} more" if len(rows) > LISTED else "")


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def load_samples(
    path: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    solution_key: str = "solution",
    max_prompt_chars: int = 0,
    on_long_prompt: str = "drop",
    allow_changed: bool = False,
) -> list[Sample]:
    """The rows of a JSONL / Parquet file or a `datasets` save_to_disk folder as Samples (see
    `titanrl.data.formats`): a prompt string or message list, a string or numeric answer, other
    columns as metadata. A malformed row is an error naming the file and the line or row; each
    Sample keeps its place (`RowSample.where`) for the token-length check (`titanrl.data.encode`).

    Prompts longer than `max_prompt_chars` characters (0 = no limit; counted on `Sample.prompt`,
    the plain text, before any chat template) are dropped with a count printed naming the file
    and the first rows (`on_long_prompt='drop'`), or are an error naming the file and row ('error').
    Each Sample keeps its file's identity (`source`, `titanrl.data.provenance`); `allow_changed`
    is data.allow_changed.
    """
    if on_long_prompt not in ("drop", "error"):
        raise ValueError(f"on_long_prompt must be 'drop' or 'error', got {on_long_prompt!r}")
    schema = RowSchema(prompt_key, answer_key, solution_key)
    samples: list[Sample] = []
    dropped, total = [], 0
    source = new_source(path, allow_changed)
    for where, row in hashed_rows(read_rows(path), source):
        total += 1
        sample = schema.to_sample(row, where)
        sample.source = source
        if max_prompt_chars and len(sample.prompt) > max_prompt_chars:
            if on_long_prompt == "error":
                raise ValueError(
                    f"{where}: the prompt has {len(sample.prompt)} characters, more than data.max_prompt_chars "
                    f"({max_prompt_chars}); shorten it, raise the limit or set data.on_long_prompt='drop'"
                )
            dropped.append((where, len(sample.prompt)))
            continue
        samples.append(sample)
    if dropped and is_rank0():
        log.info(
            f"{path}: dropped {len(dropped)} of {total} rows whose prompt is longer than data.max_prompt_chars "
            f"({max_prompt_chars} characters): {listed(dropped, 'characters')}"
        )
    if not samples:
        extra = f" left after dropping {len(dropped)} over data.max_prompt_chars" if dropped else ""
        raise ValueError(f"data.path '{path}' has no rows{extra}")
    return samples


def load_jsonl(path: str, **options) -> list[Sample]:
    """`load_samples` under its old name (the recipes' call): rows {"prompt": str | messages,
    "answer": str | number, ...}; despite the name, a .parquet / .arrow file or a datasets folder
    is read as such."""
    return load_samples(path, **options)


def samples_from_config(data: "Data") -> list[Sample]:
    """`load_samples` of data.path with the [data] section's keys and prompt-length limit."""
    return load_samples(
        data.path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        solution_key=data.solution_key,
        max_prompt_chars=data.max_prompt_chars,
        on_long_prompt=data.on_long_prompt,
        allow_changed=data.allow_changed,
    )


def held_out_split(rows: list, n_eval: int) -> tuple[list, list]:
    """(train rows, eval rows) of a data file: its first `n_eval` rows are held out for eval."""
    if len(rows) <= n_eval:
        raise ValueError(
            f"data.path has {len(rows)} rows, not more than data.num_eval_samples ({n_eval}) held out "
            "for eval; lower it or add rows"
        )
    return rows[n_eval:], rows[:n_eval]

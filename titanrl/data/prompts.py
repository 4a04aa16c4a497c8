"""Prompt streams and the per-step prompt loader (torchdata.nodes, checkpointable state).

Every rank iterates the same global stream and keeps its own strided share of each global
batch, so a run on N data-parallel ranks sees exactly the prompts of a 1-rank run.
"""

import json
import random
from collections.abc import Iterator

import torchdata.nodes as tn

from titanrl.envs.tasks import Sample, Task


class TaskStream:
    """Endless seeded samples of an embedded task (re-iterable, so its loader state can restore)."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task, self.seed = task, seed

    def __iter__(self) -> Iterator[Sample]:
        rng = random.Random(f"{self.task.name}/train/{self.seed}")
        while True:
            yield self.task.make(rng)


class DatasetStream:
    """A fixed list of samples, reshuffled every epoch with a seed."""

    def __init__(self, samples: list[Sample], seed: int) -> None:
        if not samples:
            raise ValueError("the prompt dataset is empty; check data.path")
        self.samples, self.seed = samples, seed

    def __iter__(self) -> Iterator[Sample]:
        epoch = 0
        while True:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            for i in order:
                yield self.samples[i]
            epoch += 1


def build_prompt_loader(stream, global_batch: int, dp_rank: int, dp_size: int) -> tn.Loader:
    if global_batch % dp_size:
        raise ValueError(
            f"training.batch_size ({global_batch} prompts) must be divisible by the {dp_size} data-parallel ranks"
        )
    node = tn.IterableWrapper(stream)
    node = tn.Batcher(node, batch_size=global_batch)
    node = tn.Mapper(node, lambda batch: batch[dp_rank::dp_size])
    return tn.Loader(node)


def read_jsonl_objects(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line; a missing file, invalid JSON or a non-object
    row is an error naming the file and line."""
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"data.path '{path}' does not exist") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def load_jsonl(path: str) -> list[Sample]:
    """Rows {"prompt": str, "answer": str | number, ...}; other fields become metadata.

    A malformed row is an error naming the file, the line and what is wrong.
    """
    samples = []
    for line_no, row in read_jsonl_objects(path):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{line_no}: missing or empty 'prompt' (a non-empty string is required)")
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{path}:{line_no}: 'answer' must be a string or a number, got {answer!r}")
        metadata = {k: v for k, v in row.items() if k not in ("prompt", "answer", "solution")}
        solution = row.get("solution", str(answer))
        samples.append(Sample(prompt=row["prompt"], answer=str(answer), solution=str(solution), metadata=metadata))
    if not samples:
        raise ValueError(f"data.path '{path}' has no rows")
    return samples


def held_out_split(rows: list, n_eval: int) -> tuple[list, list]:
    """(train rows, eval rows) of a data file: its first `n_eval` rows are held out for eval."""
    if len(rows) <= n_eval:
        raise ValueError(
            f"data.path has {len(rows)} rows, not more than data.num_eval_samples ({n_eval}) held out "
            "for eval; lower it or add rows"
        )
    return rows[n_eval:], rows[:n_eval]

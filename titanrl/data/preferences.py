"""Preference pairs (prompt, chosen, rejected) for DPO and reward-model training: from a data
file (JSONL, Parquet or a `datasets` folder, read as in `titanrl.data.formats`), or synthesised
from an embedded task (the task's solution is chosen, a corrupted copy of it is rejected), so
that the offline recipes run with no data files."""

import random
from dataclasses import dataclass, field

from titanrl.data.formats import check_unicode, read_rows, shown
from titanrl.data.provenance import DataSource, hashed_rows, new_source
from titanrl.data.tasks import Task

PAIR_KEYS = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    where: str = ""
    """`file:line` or `file row i` of a pair read from a file, for errors found after loading."""

    source: DataSource | None = field(default=None, repr=False, compare=False)
    """The file it was read from (`titanrl.data.provenance`), recorded in checkpoints."""


def load_preferences(path: str, allow_changed: bool = False) -> list[PreferencePair]:
    """Rows {"prompt": str, "chosen": str, "rejected": str}; a malformed row is an error naming
    the file, the line (or row) and the column. Each pair keeps its file's identity (`source`);
    `allow_changed` is data.allow_changed."""
    pairs, source = [], new_source(path, allow_changed)
    for where, row in hashed_rows(read_rows(path), source):
        for key in PAIR_KEYS:
            value = row.get(key)
            if not isinstance(value, str) or not value.strip():
                got = "nothing" if value is None else shown(value)
                raise ValueError(
                    f"{where}: missing or empty '{key}': got {got} (preference rows need non-empty "
                    "'prompt', 'chosen' and 'rejected' strings)"
                )
            check_unicode(value, where, f"'{key}'")
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"{where}: 'chosen' and 'rejected' are identical")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"], where, source))
    if not pairs:
        raise ValueError(f"data.path '{path}' has no rows")
    return pairs


def corrupt(text: str, rng: random.Random) -> str:
    """A near miss of `text`: one character replaced by another of the same kind."""
    pos = rng.randrange(len(text))
    alphabet = "0123456789" if text[pos].isdigit() else "abcdefghijklmnopqrstuvwxyz"
    choices = [c for c in alphabet if c != text[pos]]
    return text[:pos] + rng.choice(choices) + text[pos + 1 :]


def synthetic_preferences(task: Task, split: str, n: int, seed: int) -> list[PreferencePair]:
    rng = random.Random(f"{task.name}/preferences/{split}/{seed}")
    return [PreferencePair(s.prompt, s.solution, corrupt(s.solution, rng)) for s in task.samples(split, n, seed)]

"""Preference pairs (prompt, chosen, rejected) for DPO and reward-model training: from a JSONL
file, or synthesised from an embedded task (the task's solution is chosen, a corrupted copy of
it is rejected), so that the offline recipes run with no data files."""

import random
from dataclasses import dataclass

from titanrl.data.prompts import read_jsonl_objects
from titanrl.envs.tasks import Task


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def load_preferences(path: str) -> list[PreferencePair]:
    """Rows {"prompt": str, "chosen": str, "rejected": str}; a malformed row is an error naming
    the file, the line and the problem."""
    pairs = []
    for line_no, row in read_jsonl_objects(path):
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(
                    f"{path}:{line_no}: missing or empty '{key}' (preference rows need non-empty "
                    "'prompt', 'chosen' and 'rejected' strings)"
                )
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"{path}:{line_no}: 'chosen' and 'rejected' are identical")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"]))
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

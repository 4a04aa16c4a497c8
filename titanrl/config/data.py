"""`[data]`: the prompts a job trains on, an embedded task or a dataset file, and how they are
rendered. A docstring under every field; `validate()` checks them."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Data:
    task: str = "arithmetic"
    """Embedded task name (e.g. 'arithmetic', 'reverse'); not used when `path` names a file."""

    path: str = ""
    """Your own data, read instead of an embedded task, by extension: a .jsonl file (one JSON object per line), a
    .parquet file, or a Hugging Face `datasets` folder written by save_to_disk (Parquet and Arrow
    need the 'data' extra); rows with a prompt and an answer (see prompt_key, answer_key)."""

    prompt_key: str = "prompt"
    """Column of the prompt: a string, or a list of {role, content} chat messages (kept in the
    sample's metadata 'messages'); a dotted path reads a nested field, e.g. 'extra_info.question'."""

    answer_key: str = "answer"
    """Column of the reference answer (string or number); with the default, a row without it uses
    verl's reward_model.ground_truth."""

    solution_key: str = "solution"
    """Column of a worked solution for SFT; rows without it use the answer."""

    chat_template: bool = False
    """Render every prompt with the chat template of model.tokenizer's folder (tokenizer_config.json
    or chat_template.jinja; needs the 'chat' extra): a text prompt as one user message, a
    messages prompt as it is, with the generation prompt; off: bos + the prompt text."""

    system_prompt: str = ""
    """With chat_template: a system message put first in every prompt that has none."""

    max_prompt_chars: int = 0
    """Longest prompt in characters (plain text, before any chat template) kept at load; 0 = no limit."""

    on_long_prompt: Literal["drop", "error"] = "drop"
    """A row over max_prompt_chars, or too long in tokens once encoded (RL: prompt +
    generator.max_new_tokens > model.max_seq_len; SFT / DPO / RM: the whole sequence), checked at
    start-up: 'drop' it (the count and the first rows' file:line are printed) or 'error' naming
    the file and line."""

    num_eval_samples: int = 64
    """Held-out prompts used by the periodic greedy evaluation (with `path`: the file's first
    rows, which are then not trained on)."""

    allow_changed: bool = False
    """Resume even if `path` is not the data the checkpoint was trained on. A checkpoint records
    each data file's path, size and a hash of the rows read; a resume on other rows stops with
    an error naming the file, unless this is true (then a notice is printed)."""

    def validate(self) -> None:
        if self.task == "jsonl":
            raise ValueError(
                "[data] task = 'jsonl' has moved: data.path alone selects file data (.jsonl, .parquet or a "
                "datasets folder); remove data.task"
            )
        if self.num_eval_samples < 0:
            raise ValueError(f"[data] num_eval_samples must be >= 0, got {self.num_eval_samples}")
        if self.system_prompt and not self.chat_template:
            raise ValueError("[data] system_prompt needs chat_template = true (plain prompts have no roles)")
        if self.max_prompt_chars < 0:
            raise ValueError(f"[data] max_prompt_chars must be >= 0 (0 = no limit), got {self.max_prompt_chars}")
        for name in ("prompt_key", "answer_key", "solution_key"):
            if not getattr(self, name).strip():
                raise ValueError(f"[data] {name} must name a column, got {getattr(self, name)!r}")

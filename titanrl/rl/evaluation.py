"""Evaluation suites (`[[eval]]`): k samples per prompt from the in-process generator, scored by
each suite's reward in reward workers, reduced to pass@j, mean@k and counts.

The same code runs inside training (the RL recipe's `evaluate`, with the generator awake and
holding the policy's weights) and in `titanrl eval`. Data-parallel ranks take strided shares of a
suite's prompts; sample j of prompt i is seeded by (suite, i, j), so a sample does not depend on
the rank that draws it, and per-prompt sums are all-reduced in float64: any number of ranks gives
the numbers of one. Metrics (docs/evaluation.md), for a suite `s` with k samples per prompt:
  eval/s/pass@j   unbiased pass@j (titanrl/rewards/pass_at_k.py), j = 1, 2, 4, ... below k, and k
  eval/s/mean@k   the fraction of correct samples;  eval/s/reward_mean  the mean reward
  eval/s/prompts, eval/s/samples, eval/s/reward_failures
and eval/s/<source>/pass@j, mean@k, prompts for each value of the rows' `data_source` column.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titanrl.components.console import STDERR, get_logger
from titanrl.components.plugins import load_object
from titanrl.config.evaluation import EvalSuite
from titanrl.data.encode import PromptEncoder, fit_rows, prompt_room
from titanrl.data.eval_suites import SOURCE_KEY, suite_samples, suite_task
from titanrl.data.tasks import TASKS, NumericMath, Sample, Task
from titanrl.distributed import dp_sum
from titanrl.envs.agent_pool import AgentPool
from titanrl.generator import Generator, SamplingParams
from titanrl.models.chat_template import ChatTemplate
from titanrl.rewards.math_verify import gsm8k_verifier, math_verifier
from titanrl.rewards.pass_at_k import pass_at_k, pass_ks
from titanrl.rewards.runner import RewardItem, RewardResult, RewardRunner
from titanrl.rl.agent_episodes import play_agent_episodes

log = get_logger(__name__)

if TYPE_CHECKING:
    from titanrl.config import JobConfig
    from titanrl.rl.host import RolloutHost

PRESET_REWARDS = {"gsm8k": gsm8k_verifier, "aime2025": math_verifier}
"""The scorer of each preset when the suite names none."""

COUNTS = ("prompts", "samples", "correct", "reward_sum", "reward_failures")
"""What each group (the suite, then each data source) sums per prompt, before its pass@j."""


def load_suites(config: JobConfig, tasks: dict[str, Callable[[], Task]] = TASKS) -> list[tuple[EvalSuite, list]]:
    """Every suite with its prompts, read before anything is built (bad files fail in seconds)."""
    suites = []
    for suite in config.eval:
        samples = suite_samples(suite, config.job.seed, tasks)
        if not samples:
            raise ValueError(f"[[eval]] '{suite.name}' has no prompts; check its path / preset / num_samples")
        suites.append((suite, samples))
    return suites


def suite_reward(suite: EvalSuite, config: JobConfig, tasks: dict[str, Callable[[], Task]] = TASKS):
    """The suite's scorer: its `reward`, else the preset's math verifier, the task's verifier, the
    job's reward.function, or the numeric verifier (what data.path is scored with)."""
    if suite.reward:
        fn = load_object(suite.reward, f"eval '{suite.name}' reward")
        if not callable(fn) and not isinstance(fn, Task):
            raise ValueError(f"[[eval]] '{suite.name}': reward '{suite.reward}' is not callable or a Task")
        return fn
    if suite.preset:
        return PRESET_REWARDS[suite.preset]
    task = suite_task(suite, tasks)
    if task is not None:
        return task
    return load_object(config.reward.function, "reward.function") if config.reward.function else NumericMath()


@dataclass
class _Suite:
    suite: EvalSuite
    samples: list[Sample]
    prompts: list[list[int]]
    sources: list[str]
    params: SamplingParams
    rewards: RewardRunner
    template: ChatTemplate | None
    """The suite's chat template (its chat_template setting, or data's): agent episodes render with it."""


class EvalSuites:
    """The job's suites, ready to run: prompts encoded, reward workers started."""

    def __init__(
        self, host: RolloutHost, max_seq_len: int, suites: list[tuple[EvalSuite, list]], progress_s: float = 0.0
    ) -> None:
        self.host = host
        self.progress_s = progress_s  # > 0: rank 0 prints finished samples this often (`titanrl eval`)
        self.suites = [self._prepare(host, max_seq_len, suite, samples) for suite, samples in suites]

    @staticmethod
    def _prepare(host: RolloutHost, max_seq_len: int, suite: EvalSuite, samples: list[Sample]) -> _Suite:
        cfg = host.config
        data = cfg.data
        chat = data.chat_template if suite.chat_template is None else suite.chat_template
        system = data.system_prompt if suite.system_prompt is None else suite.system_prompt
        encode = PromptEncoder.from_config(
            dataclasses.replace(data, chat_template=chat, system_prompt=system if chat else ""),
            cfg.model.tokenizer,
            host.tokenizer,
        )
        max_new = suite.max_new_tokens or cfg.generator.max_new_tokens
        max_prompt, limit = prompt_room(max_seq_len, max_new)
        size = lambda s: len(encode(s.prompt, s.metadata))  # noqa: E731
        fix = f"shorten these rows, or lower the suite's max_new_tokens ([[eval]] '{suite.name}')"
        _, samples = fit_rows(None, samples, size, max_prompt, data.on_long_prompt, "encoded prompt", limit, fix)
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=suite.temperature,
            top_p=suite.top_p,
            n=suite.k,
            seed=zlib.crc32(f"{cfg.job.seed}/{suite.name}".encode()) & 0x7FFF_FFFF,
        )
        r = cfg.reward
        rewards = RewardRunner(
            suite_reward(suite, cfg), r.num_workers, r.timeout_s, r.failure_reward, r.memory_limit_mb
        )
        sources = sorted({str(s.metadata[SOURCE_KEY]) for s in samples if SOURCE_KEY in s.metadata})
        prompts = [encode(s.prompt, s.metadata) for s in samples]
        return _Suite(suite, samples, prompts, sources, params, rewards, encode.template)

    def console(self) -> dict[str, str]:
        """Console labels of the headline numbers: each suite's pass@1 and pass@k."""
        labels = {}
        for s in self.suites:
            labels[f"eval/{s.suite.name}/pass@1"] = f"{s.suite.name}@1"
            if s.suite.k > 1:
                labels[f"eval/{s.suite.name}/pass@{s.suite.k}"] = f"{s.suite.name}@{s.suite.k}"
        return labels

    def run(self, generator: Generator, agents: AgentPool | None = None) -> tuple[dict[str, float], list[RewardResult]]:
        """Every suite on an awake generator holding the weights to evaluate: (metrics, this
        rank's reward results). With `agents` (the job's [agent] pool), every sample is an agent
        episode: its reward is the agent's (or, when the agent returns None, the suite's score of
        its transcript), and it is correct when that reward is > 0 (or the scorer says so)."""
        metrics, results = {}, []
        for s in self.suites:
            suite_metrics, suite_results = self._run_suite(s, generator, agents)
            metrics.update(suite_metrics)
            results += suite_results
        return metrics, results

    def _run_suite(
        self, s: _Suite, generator: Generator, agents: AgentPool | None
    ) -> tuple[dict[str, float], list[RewardResult]]:
        dims, k = self.host.dims, s.suite.k
        mine = list(range(dims.dp_rank, len(s.samples), dims.dp_size))
        results = self._sample(s, generator, agents, mine)
        js = pass_ks(k)
        width = len(COUNTS) + len(js)
        groups = ["", *s.sources]
        sums = [0.0] * (width * len(groups))
        for local, i in enumerate(mine):
            rs = results[local * k : (local + 1) * k]
            c = sum(r.correct for r in rs)
            row = [1, k, c, sum(r.reward for r in rs), sum(r.failed is not None for r in rs)]
            row += [pass_at_k(k, c, j) for j in js]
            source = s.samples[i].metadata.get(SOURCE_KEY)
            for g in [0] + ([groups.index(str(source))] if source is not None else []):
                for col, value in enumerate(row):
                    sums[g * width + col] += value
        sums = dp_sum(sums, self.host.dp_group)
        metrics = {}
        for g, group in enumerate(groups):
            prefix = f"eval/{s.suite.name}/" + (f"{group}/" if group else "")
            metrics.update(_group_metrics(prefix, sums[g * width : (g + 1) * width], js, k, full=not group))
        return metrics, results

    def _sample(self, s: _Suite, generator: Generator, agents: AgentPool | None, mine: list[int]) -> list[RewardResult]:
        """The results of the k samples of each prompt in `mine`, ordered by (prompt, sample)."""
        # An ep-sharded generator generates on every ep rank, with or without prompts (its all-to-alls).
        if not mine and generator.lockstep is None:
            return []
        samples = [s.samples[i] for i in mine]
        if agents is not None:
            params = dataclasses.replace(s.params)
            return play_agent_episodes(agents, self.host, generator, s.rewards, samples, params, mine, s.template)[2]
        k = s.suite.k
        progress = progress_report(s.suite.name, len(mine) * k, self.progress_s) if self.host.rank == 0 else None
        prompts = [s.prompts[i] for i in mine]
        completions = generator.generate(prompts, s.params, mine, on_finish=progress)[0]
        items = [
            RewardItem(sample.prompt, c.text or "", sample.answer, sample.metadata)
            for c in completions
            for sample in (samples[c.prompt_index],)
        ]
        return s.rewards(items)

    def close(self) -> None:
        for s in self.suites:
            s.rewards.close()


def progress_report(name: str, total: int, every_s: float) -> Callable[[list], None] | None:
    """An `on_finish` callback that prints to stderr how many of `total` samples have finished,
    at most every `every_s` seconds (none for `every_s` <= 0): a long `titanrl eval` is otherwise
    silent until its summary, which alone goes to stdout."""
    if every_s <= 0:
        return None
    start = last = time.monotonic()
    done = 0

    def report(finished: list) -> None:
        nonlocal last, done
        done += len(finished)
        now = time.monotonic()
        if now - last >= every_s or done == total:
            last = now
            log.info(f"eval '{name}': {done}/{total} samples finished on rank 0 ({now - start:.0f} s)", extra=STDERR)

    return report


def _group_metrics(prefix: str, sums: list[float], js: list[int], k: int, full: bool) -> dict[str, float]:
    prompts, samples, correct, reward_sum, failures = sums[: len(COUNTS)]
    n = max(prompts, 1.0)
    metrics = {f"{prefix}pass@{j}": total / n for j, total in zip(js, sums[len(COUNTS) :])}
    metrics[f"{prefix}mean@{k}"] = correct / max(samples, 1.0)
    metrics[f"{prefix}prompts"] = prompts
    if full:
        metrics.update(
            {
                f"{prefix}samples": samples,
                f"{prefix}reward_mean": reward_sum / max(samples, 1.0),
                f"{prefix}reward_failures": failures,
            }
        )
    return metrics

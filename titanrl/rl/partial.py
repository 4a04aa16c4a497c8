"""Partial rollouts: groups in flight across steps (`rollout.partial`).

A synchronous step waits for its longest response while the rest of the batch sits idle. Here a
step decodes `rollout.oversample` times the groups it trains: the groups carried over from
earlier steps and new prompts (whole loader batches, drawn until there are that many), and ends
generation as soon as this rank's share of groups is complete (or after `rollout.max_step_tokens`
decode tokens, once one group is complete). Samples still decoding are paused: the generator
frees their KV blocks and hands back their tokens and logprobs; the next step prefills them
again and continues their random streams under the new weights. Every token keeps the logprob
of the weights that sampled it (its behaviour logprob, what the off-policy correction divides
by) and that weights' version, for the staleness metrics. Complete groups are scored and
trained on; the groups in flight are part of the checkpoint, so a resumed run continues them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from titanrl.components.console import get_logger
from titanrl.components.timer import PhaseTimer
from titanrl.data.formats import RowSample
from titanrl.data.tasks import Sample
from titanrl.distributed import dp_max, dp_sum
from titanrl.generator import Completion, GenerationStats, ResumedSample
from titanrl.generator.sequence import FinishReason
from titanrl.rl.groups import RolloutCounts, Rollouts
from titanrl.rl.rollouts import RolloutCollector

log = get_logger(__name__)


def finished(reason: FinishReason | None) -> FinishReason:
    """The finish reason of a sample of a done group (every sample there has finished)."""
    assert reason is not None, "a done group's samples have all finished"
    return reason


@dataclass
class SampleState:
    """One sample of a group in flight."""

    key: int
    """Its random stream (continued when it resumes)."""
    token_ids: list[int]
    logprobs: list[float]
    """Behaviour logprob of each token: under the weights that sampled it."""
    versions: list[int]
    """Weight version that sampled each token (training steps completed before it)."""
    finish_reason: FinishReason | None = None
    """None while paused."""


@dataclass
class Group:
    sample: Sample
    prompt: list[int]
    prompt_id: int
    """Global id (seeds the group's sample keys when it starts)."""
    samples: list[SampleState] = field(default_factory=list)
    """Empty until the group's prompt has been prefilled and its samples forked."""

    @property
    def complete(self) -> bool:
        return bool(self.samples) and all(s.finish_reason is not None for s in self.samples)


class PartialRolloutCollector(RolloutCollector):
    """`RolloutCollector` whose `collect` carries unfinished groups over to the next step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.baseline_rollout:
            raise ValueError("[rollout] partial = true does not support algorithms with a baseline rollout (remax)")
        self.in_flight: list[Group] = []
        self.drawn = 0
        """Prompts this rank has drawn from its loader."""

    def collect(self, batches: Iterator, step: int, timer: PhaseTimer) -> tuple[Rollouts, Rollouts]:
        """(the groups completed this step, scored, twice: trained and generated); the staleness
        metrics, reduced over the data-parallel ranks, go with them (collective)."""
        cfg = self.config
        quota = cfg.training.batch_size // self.host.dims.dp_size  # this rank's share
        version = step - 1
        restarted = self._restart_stale(version)
        groups = list(self.in_flight)
        while len(groups) < cfg.rollout.oversample * quota:
            groups.extend(self._new_groups(next(batches)))
        params = self.sampling_params(step, 0)
        with timer("generate"):
            completions, gen_stats = self.generator.generate(
                [g.prompt for g in groups],
                params,
                [g.prompt_id for g in groups],
                resume=_resumed(groups),
                pause_when=self._pause_when(groups, quota),
            )
        _update(groups, completions, version)
        done = [g for g in groups if g.complete]
        self.in_flight = [g for g in groups if not g.complete]
        trained = self._rollouts(done)
        with timer("reward"):
            results, rewards_N, rm_sum = self.scorer.score(
                [g.sample for g in done], trained.prompts, trained.completions, None
            )
        trained.results, trained.rewards = results, rewards_N.tolist()
        trained.counts = RolloutCounts(
            gen_tokens=gen_stats.decode_tokens + gen_stats.prefill_tokens,
            rm_score_sum=rm_sum,
            decode_steps=gen_stats.decode_steps,
            compile_s=gen_stats.compile_seconds,
        )
        staleness = {**self._staleness(done, version, gen_stats), "restarted_groups": float(restarted)}
        trained.metrics = self._reduced(staleness)
        return trained, trained

    def _restart_stale(self, version: int) -> int:
        """Restart (from the prompt, tokens discarded) the groups in flight whose oldest token is
        more than rollout.max_staleness versions behind `version`; returns how many."""
        bound = self.config.rollout.max_staleness
        stale = [
            g
            for g in self.in_flight
            if bound and any(s.versions and version - s.versions[0] > bound for s in g.samples)
        ]
        for g in stale:
            g.samples = []
        return len(stale)

    def _new_groups(self, samples: list[Sample]) -> list[Group]:
        """Groups of a loader batch; their ids count this rank's share of the global stream (the
        loader hands rank r prompts r, r + dp, ... of each global batch)."""
        dims = self.host.dims
        first, self.drawn = self.drawn, self.drawn + len(samples)
        return [
            Group(s, self.host.encode_prompt(s.prompt, s.metadata), (first + i) * dims.dp_size + dims.dp_rank)
            for i, s in enumerate(samples)
        ]

    def _pause_when(self, groups: list[Group], quota: int):
        G, budget = self.config.algorithm.group_size, self.config.rollout.max_step_tokens
        finished_before = [sum(s.finish_reason is not None for s in g.samples) for g in groups]

        def pause_when(finished: list[tuple[int, int]], gen_stats: GenerationStats) -> bool:
            now = Counter(p for p, _ in finished)
            complete = sum(before + now[i] >= G for i, before in enumerate(finished_before))
            return complete >= quota or (0 < budget <= gen_stats.decode_tokens and complete >= 1)

        return pause_when

    def _rollouts(self, done: list[Group]) -> Rollouts:
        tokenizer = self.host.tokenizer
        completions = [
            Completion(
                i, j, s.token_ids, s.logprobs, finished(s.finish_reason), text=tokenizer.decode(s.token_ids), key=s.key
            )
            for i, g in enumerate(done)
            for j, s in enumerate(g.samples)
        ]
        return Rollouts([g.prompt for g in done], completions, [], [])

    def _staleness(self, done: list[Group], version: int, gen_stats: GenerationStats) -> dict[str, float]:
        """This rank's sums; `_reduced` reduces them over the data-parallel ranks."""
        samples = [s for g in done for s in g.samples]
        lags = [version - min(s.versions) for s in samples if s.versions]
        return {
            "stale_tokens": float(sum(v < version for s in samples for v in s.versions)),
            "tokens": float(sum(len(s.versions) for s in samples)),
            "lag_sum": float(sum(lags)),
            "lag_max": float(max(lags, default=0)),
            "samples": float(len(samples)),
            "in_flight_groups": float(len(self.in_flight)),
            "paused_samples": float(gen_stats.paused),
        }

    def _reduced(self, s: dict[str, float]) -> dict[str, float]:
        """Staleness of the trained samples, over data-parallel ranks (collective)."""
        stale, tokens, lag_sum, samples, in_flight, paused, restarted = dp_sum(
            [
                s["stale_tokens"],
                s["tokens"],
                s["lag_sum"],
                s["samples"],
                s["in_flight_groups"],
                s["paused_samples"],
                s["restarted_groups"],
            ],
            self.host.dp_group,
        )
        (lag_max,) = dp_max([s["lag_max"]], self.host.dp_group)
        return {
            "stale_token_frac": stale / max(tokens, 1.0),
            "version_lag_mean": lag_sum / max(samples, 1.0),
            "version_lag_max": lag_max,
            "in_flight_groups": in_flight,
            "paused_samples": paused,
            "trained_groups": samples / self.config.algorithm.group_size,
            "restarted_groups": restarted,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only (dicts, lists, numbers, strings), so that the checkpoint's host
        state loads with `weights_only=True`."""
        in_flight = [asdict(g) for g in self.in_flight]
        return {"layout": _layout(self.host.dims), "in_flight": in_flight, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        # Another layout: the groups are another data shard's, or TP peers would disagree.
        if state["layout"] != _layout(self.host.dims):
            if self.host.rank == 0:
                log.info(
                    f"partial rollouts: the groups in flight were saved with another parallel layout "
                    f"({state['layout']}, now {_layout(self.host.dims)}): dropped"
                )
            return
        self.in_flight, self.drawn = [_group(g) for g in state["in_flight"]], state["drawn"]


def _layout(dims) -> dict[str, int]:
    return {"dp_rank": dims.dp_rank, "dp_size": dims.dp_size, "tp": dims.tp}


def _group(state: dict[str, Any]) -> Group:
    """A group in flight from its `asdict` form in a checkpoint."""
    samples = [SampleState(**s) for s in state["samples"]]
    sample = RowSample(**state["sample"]) if "where" in state["sample"] else Sample(**state["sample"])
    return Group(sample, state["prompt"], state["prompt_id"], samples)


def _resumed(groups: list[Group]) -> list[ResumedSample]:
    return [
        ResumedSample(i, j, s.key, s.token_ids, s.logprobs)
        for i, g in enumerate(groups)
        for j, s in enumerate(g.samples)
        if s.finish_reason is None
    ]


def _update(groups: list[Group], completions: list[Completion], version: int) -> None:
    """Fold one generate call's completions into the groups: new tokens get `version`; a group
    paused before its prompt was prefilled stays unstarted."""
    by_group: dict[int, list[Completion]] = {}
    for c in completions:
        by_group.setdefault(c.prompt_index, []).append(c)
    for i, cs in by_group.items():
        g = groups[i]
        if not g.samples:
            if all(c.finish_reason == "paused" and not c.token_ids for c in cs):
                continue
            g.samples = [SampleState(c.key, [], [], []) for c in cs]
        for c in cs:
            s = g.samples[c.sample_index]
            s.versions.extend([version] * (len(c.token_ids) - len(s.token_ids)))
            s.token_ids, s.logprobs = list(c.token_ids), list(c.logprobs)
            s.finish_reason = None if c.finish_reason == "paused" else c.finish_reason

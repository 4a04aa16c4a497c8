"""Streams: continuous batching that never drains, for asynchronous RL's rollout ranks.

`stream(generator, feed, params)` runs scheduler passes for as long as `feed` wants. Before
every pass the feed may
  - stamp the tokens of the last pass with the weight version that sampled them (`stamp_versions`);
  - take the samples finished since (`take_finished`), their blocks already freed;
  - swap the generator's weights in place (then `forget_prefixes`): the samples in flight keep
    their KV (PipelineRL), or are prefilled again under the new weights (`recompute_all`);
  - add groups (`add_prompts`), each with its own seed, behind the waiting ones.
It blocks while neither it nor the scheduler has work, and returns False to end the stream:
samples still in flight are dropped and their blocks freed.
"""

from collections.abc import Callable

import torch

from titanrl.generator.generator import Generator
from titanrl.generator.sampling import SamplingParams
from titanrl.generator.scheduler import Scheduler
from titanrl.generator.sequence import GenerationStats, Seq
from titanrl.generator.step_loop import StepLoop


class StreamScheduler(Scheduler):
    """A `Scheduler` that groups join while it runs, whose tokens carry weight versions."""

    def __init__(self, *args, check: Callable[[list[list[int]]], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.check = check
        """What the generator checks of a `generate` call's prompts (ids, lengths, pool size)."""

    def add_prompts(self, prompts: list[list[int]], prompt_ids: list[int], seeds: list[int]) -> list[int]:
        """Queue groups behind the waiting ones (sample j of prompt i draws from the stream of
        (seeds[i], prompt_ids[i], j)); their indices, the results' `prompt_index`."""
        self.check(prompts)
        first = len(self.prompt_ids)
        self.prompt_ids.extend(prompt_ids)
        self.seeds.extend(seeds)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.waiting.extend(
            Seq(first + i, 0, list(p), len(p), self.params, 0, is_group_prompt=True) for i, p in enumerate(prompts)
        )
        return list(range(first, first + len(prompts)))

    def stamp_versions(self, version: int) -> None:
        """Give the tokens sampled since the last stamp the weight version that sampled them."""
        for seq in self.running + self.prefilling + self.waiting + self.finished:
            seq.versions.extend([version] * (len(seq.token_ids) - seq.prompt_len - len(seq.versions)))

    def take_finished(self) -> list[Seq]:
        """The samples finished since the last call (their blocks already freed)."""
        done, self.finished = self.finished, []
        return done

    def recompute_all(self) -> None:
        """Free the KV of every sample in flight: each is prefilled again (under the weights of
        then) before it decodes on (`rollout.recompute_kv`)."""
        for seq in list(reversed(self.running)) + list(reversed(self.prefilling)):
            self._preempt(seq)
        self.running, self.prefilling = [], []


StreamFeed = Callable[[StreamScheduler], bool]
"""A stream's driver: called before every scheduler pass (the module docstring says what it may do)."""


@torch.no_grad()
def stream(gen: Generator, feed: StreamFeed, params: SamplingParams) -> GenerationStats:
    """Run `feed`'s stream on `gen` (awake) until `feed` returns False; the stream's stats."""
    if gen.pool is None or gen.allocator is None:
        raise RuntimeError("stream() on a sleeping generator: call wake() first")
    params.validate()
    sched = StreamScheduler(
        gen.pool,
        gen.allocator,
        gen.config,
        [],
        [],
        params,
        max_seq_len=gen.args.max_seq_len,
        vocab_size=gen.args.vocab_size,
        window=gen.window_pages,
        check=lambda prompts: gen._validate(prompts, params, (), partial_turns=False),
    )
    StepLoop.of(gen, sched).run_stream(lambda: feed(sched))
    return sched.stats


def forget_prefixes(gen: Generator) -> None:
    """After an in-place weight swap mid-stream: cached prompt blocks hold the old weights' K/V,
    so no new prompt may reuse them (the samples holding them keep them)."""
    if gen.allocator is not None:
        gen.allocator.reset_prefix_cache(live=True)
    if gen.window_pages is not None:
        gen.window_pages.allocator.reset_prefix_cache(live=True)

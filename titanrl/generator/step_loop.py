"""One `Generator.generate` call's scheduler passes: prefill, decode, sample, turns and pauses.

Each pass admits and prefills while there is room (`scheduler.py`), else decodes several steps
on the device (`decode.py`), or one step when a stop needs the host; both while a long context
is prefilled chunk by chunk. The forwards run on the generator's `ModelRunner`.
"""

from collections.abc import Callable
from typing import Any

import torch

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator.decode import DecodeRows
from titanrl.generator.kv_cache import KVCachePool
from titanrl.generator.model_runner import ModelRunner
from titanrl.generator.paged_attention import SeqSlice
from titanrl.generator.routes import add_route_chunk, record_packed_routes, record_prefill_routes
from titanrl.generator.sampling import sample_tokens, sampled_logprobs
from titanrl.generator.scheduler import Scheduler
from titanrl.generator.sequence import Completion, PauseWhen, Seq, TurnHandler
from titanrl.generator.window_pages import WindowPages
from titanrl.models.tokenizer import Tokenizer


class StepLoop:
    """Runs `sched` to the end over `runner` and `pool`. A sample stops at a token of `eos_ids`
    or its stop tokens / strings (`tokenizer` decodes for the strings), or at its length limits;
    MoE routes of cached prompt blocks live in `block_routes` (`routes.record_prefill_routes`)."""

    def __init__(
        self,
        runner: ModelRunner,
        pool: KVCachePool,
        sched: Scheduler,
        config: GeneratorConfig,
        *,
        eos_ids: frozenset[int],
        tokenizer: Tokenizer | None,
        block_routes: dict[int, torch.Tensor],
    ) -> None:
        self.state_slots = runner.state_slots
        """A hybrid model's recurrent-state slots (`state_slots.py`); None for a plain transformer."""
        self.runner = runner
        self.pool = pool
        self.sched = sched
        self.config = config
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.block_routes = block_routes
        self.window: WindowPages | None = sched.blocks.window
        """Sliding-window layers' pages, when the model has such layers (`window_pages.py`)."""

    @classmethod
    def of(cls, gen: Any, sched: Scheduler) -> "StepLoop":
        """The loop of `sched` over a `Generator`'s runner, pool and stop tokens."""
        return cls(
            gen.runner,
            gen.pool,
            sched,
            gen.config,
            eos_ids=gen.eos_ids,
            tokenizer=gen.tokenizer,
            block_routes=gen.block_routes,
        )

    def run(
        self,
        turns: TurnHandler | None,
        pause_when: PauseWhen | None,
        on_finish: Callable[[list[Completion]], None] | None,
    ) -> None:
        """Scheduler passes until every sample finished or paused: admit and prefill while there is
        room, else decode (both while a long context is prefilled chunk by chunk); report finished
        samples to `on_finish` after each pass."""
        if turns is not None and self.state_slots is not None:
            raise ValueError("multi-turn environments are not supported for hybrid linear-attention models yet")
        try:
            self._passes(turns, pause_when, on_finish)
        finally:
            if self.state_slots is not None:  # every slot free for the next call
                self.state_slots.release_all()

    def _passes(
        self,
        turns: TurnHandler | None,
        pause_when: PauseWhen | None,
        on_finish: Callable[[list[Completion]], None] | None,
    ) -> None:
        sched, lockstep = self.sched, self.runner.lockstep
        reported = 0
        # Under expert parallelism: while any ep rank has work; a rank without serves the peers' all-to-alls.
        while sched.has_work if lockstep is None else lockstep.more_passes(sched.has_work):
            if not sched.has_work:
                continue
            if turns is not None and not sched.exchange_turns():
                sched.stats.steps += 1
                sched.stats.scheduler_passes += 1
                continue
            self._pass(turns)
            if turns is not None:
                sched.pause()
            if (
                pause_when is not None
                and sched.has_work
                and pause_when([(s.prompt_index, s.sample_index) for s in sched.finished], sched.stats)
            ):
                sched.pause_all()
            self._release_state_slots()
            if on_finish is not None:  # single-turn: `finished` only grows
                on_finish(
                    [s.to_completion(self.tokenizer) for s in sched.finished[reported:] if s.finish_reason != "paused"]
                )
                reported = len(sched.finished)

    def _pass(self, turns: TurnHandler | None) -> None:
        """One scheduler pass: admit and prefill while there is room, else decode (both while a
        long context is prefilled chunk by chunk)."""
        sched = self.sched
        sched.stats.steps += 1
        sched.stats.scheduler_passes += 1
        prefill = sched.admit()
        if prefill:
            with torch.profiler.record_function("generator/prefill"):
                self._prefill(prefill)
        if not prefill or sched.prefilling:
            # A chunked prefill continues next pass: the running samples decode in between.
            sched.stats.steps += bool(prefill)
            self._decode(turns)

    def run_stream(self, feed: Callable[[], bool]) -> None:
        """Passes for as long as `feed` (asked before each, `stream.py`) keeps the stream going;
        then every sample still in flight is dropped and its blocks freed."""
        if self.runner.lockstep is not None:
            raise ValueError("a generator stream cannot run under expert parallelism (ep lockstep) yet")
        try:
            while feed():
                if self.sched.has_work:
                    self._pass(None)
                    self._release_state_slots()
        finally:
            self.sched.pause_all()
            self.sched.finished = []
            if self.state_slots is not None:
                self.state_slots.release_all()

    def _prefill(self, seqs: list[Seq]) -> None:
        """One packed forward over this step's context tokens of the admitted sequences (up to
        `prefill_end`: a chunk of a long context attends to the K/V its earlier chunks left in the
        blocks); each group prompt's last row then gives its samples their first token."""
        slices: list[SeqSlice] = []
        tokens: list[int] = []
        last_index: list[int] = []
        starts: list[int] = []
        row: dict[int, int] = {}
        for seq in seqs:
            end = seq.prefill_end
            new = seq.token_ids[seq.num_computed : end]
            starts.append(seq.num_computed)
            if self.state_slots is not None and seq.num_computed == 0:
                if seq.state_slot < 0:
                    seq.state_slot = self.state_slots.allocate()
                else:  # recomputing its context (after preemption): from the zero state
                    self.state_slots.zero(seq.state_slot)
            slices.append(SeqSlice(seq.block_table, end, len(new), seq.state_slot))
            tokens.extend(new)
            if end == seq.context_end:  # the last chunk: its last row is sampled
                row[id(seq)] = len(last_index)
                last_index.append(len(tokens) - 1)
            self.sched.stats.prefill_tokens += len(new)
            seq.num_computed = end
        # Logits only at each finished context's last token: the rows that are sampled (a full
        # [prompt tokens, vocab] projection would dominate prefill memory at a real vocabulary).
        logits_SV = self.runner.forward(
            self.pool,
            slices,
            tokens,
            logits_at=last_index,
            state_slots=self.state_slots,
            window=self._window_slices(seqs, slices),
        )
        if self.runner.record_routes:
            counts, B = [s.num_new for s in slices], self.config.block_size
            record_prefill_routes(seqs, starts, counts, self.runner.model.moe_routes(), self.block_routes, B)
        samples: list[Seq] = []
        rows: list[int] = []
        for seq in seqs:
            forked = self.sched.after_prefill(seq)
            self._share_prompt_state(seq, forked)
            samples.extend(forked)
            rows.extend(row[id(seq)] for _ in forked)
        if samples:
            self._sample(samples, logits_SV[rows])

    def _decode(self, turns: TurnHandler | None) -> None:
        """Tokens for every running sequence (preempting some if blocks run out): several steps
        on device per scheduler pass (`decode.py`), or one step when a stop needs the host
        (stop strings, multi-turn) or the step is not the tensor-only kind (top logprobs)."""
        sched = self.sched
        batch = sched.schedule_decode()
        if not batch:
            return
        params = batch[0].params
        # Hybrid models decode step by step (the state slots are read eagerly, not in the device loop).
        if turns is not None or params.stop_strings or params.num_top_logprobs or self.state_slots is not None:
            return self._decode_one_step(batch)
        steps, left = sched.reserve_ahead(batch, self.config.decode_steps_per_schedule)
        stop_ids = sorted(self.eos_ids | set(params.stop_token_ids))
        rows = DecodeRows(
            tokens=[s.token_ids[-1] for s in batch],
            positions=[len(s.token_ids) - 1 for s in batch],
            left=left,
            keys=[s.key for s in batch],
            tables=[s.block_table for s in batch],
            window_tables=[self.window.table(s) for s in batch] if self.window is not None else None,
        )
        with torch.profiler.record_function("generator/decode"):
            out = self.runner.decode_pass(
                self.pool,
                params,
                rows,
                steps=steps,
                stop_ids=stop_ids,
                end_when_any_stops=bool(sched.waiting),
                window=self.window,
            )
        sched.stats.steps += out.steps - 1
        sched.stats.decode_steps += out.steps
        for i, (seq, tokens, logprobs, stopped) in enumerate(zip(batch, out.tokens, out.logprobs, out.stopped)):
            if out.routes is not None:
                add_route_chunk(seq, len(seq.token_ids) - 1, out.routes[i])
            seq.token_ids.extend(tokens)
            seq.logprobs.extend(logprobs)
            seq.num_computed = len(seq.token_ids) - 1
            sched.stats.decode_tokens += len(tokens)
            reason = ("stop" if tokens[-1] in stop_ids else "length") if stopped else None
            if reason is None:
                sched.blocks.trim(seq)
            sched.after_sample(seq, reason)

    def _decode_one_step(self, batch: list[Seq]) -> None:
        slices = [SeqSlice(s.block_table, len(s.token_ids), 1, s.state_slot) for s in batch]
        tokens = [s.token_ids[-1] for s in batch]
        with torch.profiler.record_function("generator/decode"):
            logits_NV = self.runner.forward(
                self.pool,
                slices,
                tokens,
                decode=True,
                state_slots=self.state_slots,
                window=self._window_slices(batch, slices),
            )
        if self.runner.record_routes:
            starts = [len(s.token_ids) - 1 for s in batch]
            record_packed_routes(batch, starts, [1] * len(batch), self.runner.model.moe_routes())
        self.sched.stats.decode_tokens += len(batch)
        self.sched.stats.decode_steps += 1
        for seq in batch:
            seq.num_computed = len(seq.token_ids)
        self._sample(batch, logits_NV)

    def _window_slices(self, seqs: list[Seq], slices: list[SeqSlice]) -> tuple[WindowPages, list[SeqSlice]] | None:
        """`slices` over the sequences' window tables (None: the model has no window pool)."""
        if self.window is None:
            return None
        window = self.window
        return window, [SeqSlice(window.table(q), s.context_len, s.num_new) for q, s in zip(seqs, slices)]

    def _share_prompt_state(self, prompt: Seq, samples: list[Seq]) -> None:
        """A group's samples continue from its prompt's recurrent state: the first takes over the
        prompt's slot, the others get copies (GRPO prefix sharing for hybrid models)."""
        if self.state_slots is None or not samples:
            return
        samples[0].state_slot, prompt.state_slot = prompt.state_slot, -1
        for sample in samples[1:]:
            sample.state_slot = self.state_slots.allocate()
            self.state_slots.copy(samples[0].state_slot, sample.state_slot)

    def _release_state_slots(self) -> None:
        """Slots of finished samples, and of preempted ones (they recompute into a fresh slot)."""
        if self.state_slots is None:
            return
        for seq in self.sched.finished + self.sched.waiting:
            if seq.state_slot >= 0:
                self.state_slots.free(seq.state_slot)
                seq.state_slot = -1

    def _sample(self, seqs: list[Seq], logits_NV: torch.Tensor) -> None:
        """Sample the next token of each seq from its row of `logits_NV`; the scheduler keeps it
        running or retires it."""
        with torch.profiler.record_function("generator/sample"):
            keys_N = torch.tensor([seq.key for seq in seqs], device=logits_NV.device)
            counters_N = torch.tensor([len(seq.token_ids) for seq in seqs], device=logits_NV.device)
            tokens_N = sample_tokens(logits_NV, seqs[0].params, keys_N, counters_N)
            logprobs_N = sampled_logprobs(logits_NV, tokens_N).tolist()
            tokens = tokens_N.tolist()
        num_top = seqs[0].params.num_top_logprobs
        if num_top:
            top = torch.log_softmax(logits_NV.float(), -1).topk(num_top)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.token_ids.append(token)
            seq.logprobs.append(logprobs_N[i])
            if num_top:
                seq.top_logprobs.append(list(zip(top_ids[i], top_lps[i])))
            self.sched.after_sample(seq, self._finish_reason(seq, token))

    def _finish_reason(self, seq: Seq, token: int) -> str | None:
        if token in self.eos_ids or token in seq.params.stop_token_ids:
            return "stop"
        if seq.params.stop_strings:
            assert self.tokenizer is not None, "stop strings without a tokenizer (Generator._validate refuses them)"
            text = self.tokenizer.decode(seq.turn_token_ids)
            if any(s in text for s in seq.params.stop_strings):
                return "stop"
        if seq.num_generated >= seq.params.max_new_tokens or len(seq.token_ids) >= self.runner.args.max_seq_len:
            return "length"
        return None

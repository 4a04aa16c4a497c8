"""Continuous batching over the paged KV cache: admission, preemption, turns.

One `Scheduler` lives for one `Generator.generate` call. Each step either prefills the waiting
sequences that fit (a group's prompt once, then its `n` samples fork its blocks, copy-on-write
for the partly filled last block) or decodes one token of every running sample. A context longer
than the step's token budget is prefilled in chunks (`enable_chunked_prefill`): its blocks are
reserved at admission, each step computes the next chunk, and the running samples decode between
chunks; its samples fork after the last one. When blocks run out while decoding, the youngest
sample is preempted: its blocks are freed and it is recomputed once it is admitted again.
Decisions depend only on token ids and block counts, which agree across the ranks of a TP group,
so every rank builds the same schedule. Each sequence's block table is kept by
`block_accounting.py`; multi-turn samples wait on their environment in `turn_exchange.py`.
"""

from collections.abc import Sequence

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator.block_accounting import BlockAccounting
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks
from titanrl.generator.sampling import SamplingParams
from titanrl.generator.sequence import GenerationStats, ResumedSample, Seq, TurnHandler
from titanrl.generator.turn_exchange import TurnExchange
from titanrl.generator.window_pages import WindowPages


class Scheduler:
    """Queues of one `generate` call: `waiting` (group prompts, preempted samples and resumed
    multi-turn samples, front first), `prefilling` (admitted, holding blocks for their whole
    context, part of it computed: chunked prefill), `running` (decode next step, oldest first),
    `finished`, and in `exchange` the multi-turn samples in an environment step, holding their
    blocks."""

    def __init__(
        self,
        pool: KVCachePool,
        allocator: BlockAllocator,
        config: GeneratorConfig,
        prompts: list[list[int]],
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        max_seq_len: int,
        vocab_size: int,
        turns: TurnHandler | None = None,
        resume: Sequence[ResumedSample] = (),
        window: WindowPages | None = None,
    ) -> None:
        self.blocks = BlockAccounting(pool, allocator, config.block_size, window)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.params = params
        self.prompt_ids = prompt_ids
        seed = params.seed if params.seed is not None else 0
        self.seeds = [seed] * len(prompts)
        """Each prompt's sampling seed: `params.seed`, or per prompt in a stream (`add_prompts`)."""
        self.max_seq_len = max_seq_len
        self.exchange = TurnExchange(turns, max_seq_len, vocab_size) if turns is not None else None
        self.stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        # Resumed samples first (the oldest work); their prompts are not forked again.
        resumed = {r.prompt_index for r in resume}
        self.waiting: list[Seq] = [
            Seq(
                r.prompt_index,
                r.sample_index,
                prompts[r.prompt_index] + r.token_ids,
                len(prompts[r.prompt_index]),
                params,
                r.key,
                logprobs=list(r.logprobs),
            )
            for r in resume
        ] + [
            Seq(i, 0, list(p), len(p), params, 0, is_group_prompt=True)
            for i, p in enumerate(prompts)
            if i not in resumed
        ]
        self.prefilling: list[Seq] = []
        self.running: list[Seq] = []
        self.finished: list[Seq] = []

    @property
    def has_work(self) -> bool:
        paused = self.exchange is not None and bool(self.exchange.paused)
        return bool(self.waiting or self.prefilling or self.running or paused)

    def results(self) -> list[Seq]:
        """The finished samples ordered by (prompt, sample), once every block is back."""
        assert all(rc == 0 for rc in self.blocks.allocator.ref_count), "KV blocks leaked"
        window = self.blocks.window
        assert window is None or all(rc == 0 for rc in window.allocator.ref_count), "window KV blocks leaked"
        return sorted(self.finished, key=lambda s: (s.prompt_index, s.sample_index))

    # ---- prefill ----

    def admit(self) -> list[Seq]:
        """This step's prefill, up to the per-step token budget: the next chunk of the sequences
        being prefilled, then waiting sequences whose whole context fits into blocks now. Each
        returned sequence's `prefill_end` says how far this step computes its context."""
        admitted: list[Seq] = []
        budget = self.max_num_batched_tokens
        for seq in self.prefilling:
            if budget <= 0:
                break
            n = self._take_chunk(seq, budget)
            # A sliding-window layer's pages of this chunk (`window_pages.py`): else wait for them.
            if not self.blocks.reserve_window_chunk(seq, can_wait=bool(admitted or self.running)):
                break
            budget -= n
            admitted.append(seq)
        # Sequences decoding once this step's admissions (and those being prefilled) have forked.
        num_seqs = len(self.running) + sum(self._num_after(s) for s in self.prefilling)
        while self.waiting and (budget > 0 or not admitted):
            seq = self.waiting[0]
            n_after = self._num_after(seq)
            if num_seqs + n_after > self.max_num_seqs:
                break
            to_compute = seq.context_end
            new_tokens = to_compute - seq.num_computed if seq.block_table else to_compute
            if admitted and new_tokens > budget and not self.chunked_prefill:
                break
            # Blocks for the whole context, plus one per sample to start decoding, must be free now.
            can_wait = bool(admitted or self.running)  # others will free blocks when they finish
            if not self.blocks.fits(seq, to_compute, n_after) and can_wait:
                break
            if not self.blocks.reserve_context(seq, to_compute, can_wait):
                break
            self.prefilling.append(self.waiting.pop(0))
            if seq.is_group_prompt:
                self.stats.prefix_cache_hit_tokens += seq.num_computed
            admitted.append(seq)
            budget -= self._take_chunk(seq, budget)
            self.blocks.reserve_window_chunk(seq, can_wait=True)  # gives back the pages past the chunk
            num_seqs += n_after
        return admitted

    def _num_after(self, seq: Seq) -> int:
        """Sequences `seq` decodes as once prefilled: a group prompt forks its `n` samples."""
        return self.params.n if seq.is_group_prompt else 1

    def _take_chunk(self, seq: Seq, budget: int) -> int:
        """Set `seq.prefill_end` for this step: the rest of its context, or with chunked prefill
        at most `budget` tokens of it. Returns the tokens this step computes."""
        left = seq.context_end - seq.num_computed
        assert left > 0, "a sequence in prefill has nothing left to compute"
        n = min(left, budget) if self.chunked_prefill else left
        seq.prefill_end = seq.num_computed + n
        return n

    def after_prefill(self, seq: Seq) -> list[Seq]:
        """After a prefill forward computed `seq`'s context up to `num_computed`. Short of its end
        (chunked prefill), `seq` stays in `prefilling` for its next chunk. Else: register its full
        prompt blocks for prefix caching; a group prompt forks its `n` samples (returned: they
        sample their first token from its last logits row) and lets go of its blocks; any other
        sequence goes back to running."""
        if seq.num_computed < seq.context_end:
            self.stats.prefill_chunks += 1
            self.blocks.release_behind_window(seq)
            return []
        self.prefilling.remove(seq)
        self.blocks.register_prompt_blocks(seq)
        if not seq.is_group_prompt:
            # Resumed (after preemption or an environment step): its next token is already sampled.
            self.blocks.release_behind_window(seq)
            self.running.append(seq)
            return []
        samples = [
            self.blocks.fork(seq, j, sample_key(self.seeds[seq.prompt_index], self.prompt_ids[seq.prompt_index], j))
            for j in range(seq.params.n)
        ]
        self.blocks.free(seq)  # the samples hold their own references
        return samples

    # ---- decode ----

    def schedule_decode(self) -> list[Seq]:
        """All running sequences, each with a writable slot for the token it feeds in. When
        blocks run out, the youngest sequence is preempted and the slot retried."""
        batch: list[Seq] = []
        while self.running:
            seq = self.running.pop(0)
            try:
                self.blocks.reserve_slot(seq)
                batch.append(seq)
            except OutOfBlocks:
                # Preempt the youngest sequence (the last one admitted) and retry this one; one in
                # the middle of a chunked prefill before those already in this decode batch.
                victims = self.running or self.prefilling or batch
                assert victims, "a lone sequence ran out of blocks; _validate should have refused it"
                self.running.insert(0, seq)
                self._preempt(victims.pop())
        return batch

    def tokens_left(self, seq: Seq) -> int:
        """Tokens `seq` may still add: its max_new_tokens budget, and the model's context."""
        return min(seq.params.max_new_tokens - seq.num_generated, self.max_seq_len - len(seq.token_ids))

    def reserve_ahead(self, batch: list[Seq], max_steps: int) -> tuple[int, list[int]]:
        """Blocks for the next decode steps of every sequence in `batch` (each already has a
        writable slot for its next one). Returns the number of steps reserved and each
        sequence's tokens left (`BlockAccounting.reserve_steps`)."""
        lefts = [self.tokens_left(s) for s in batch]
        return self.blocks.reserve_steps(batch, lefts, max_steps), lefts

    def _preempt(self, seq: Seq) -> None:
        """Free all of `seq`'s blocks; it resumes later by recomputing its context."""
        self.blocks.free(seq)
        seq.num_computed = 0
        self.waiting.insert(0, seq)
        self.stats.preemptions += 1

    def after_sample(self, seq: Seq, finish_reason: str | None) -> None:
        """`seq` has a new token: keep it running, or retire it with `finish_reason`."""
        if finish_reason is None:
            self.blocks.release_behind_window(seq)
            self.running.append(seq)
            return
        seq.finish_reason = finish_reason
        if self.exchange is None:  # a multi-turn sample keeps its blocks for its next turn
            self.blocks.free(seq)
        self.finished.append(seq)

    def pause_all(self) -> None:
        """Finish every unfinished sample as 'paused' and free its blocks: a group prompt not
        yet prefilled comes back as its `n` samples without tokens."""
        for seq in self.running + self.prefilling + self.waiting:
            self.blocks.free(seq)
            if seq.is_group_prompt:
                self.finished.extend(
                    Seq(
                        seq.prompt_index,
                        j,
                        list(seq.token_ids),
                        seq.prompt_len,
                        seq.params,
                        sample_key(self.seeds[seq.prompt_index], self.prompt_ids[seq.prompt_index], j),
                        finish_reason="paused",
                    )
                    for j in range(seq.params.n)
                )
            else:
                seq.finish_reason = "paused"
                self.finished.append(seq)
            self.stats.paused += 1 if not seq.is_group_prompt else seq.params.n
        self.running, self.prefilling, self.waiting = [], [], []

    # ---- multi-turn ----

    def exchange_turns(self) -> bool:
        """Start of a multi-turn step: resume the samples whose environment step is done
        (waiting for one when nothing else could run) and hand over those whose turn ended.
        False when no sample can run this step."""
        assert self.exchange is not None, "exchange_turns() without a TurnHandler"
        resumed, ended = self.exchange.collect(block=not (self.waiting or self.prefilling or self.running))
        for seq in ended:
            self.blocks.free(seq)
            self.finished.append(seq)
        for seq in resumed:
            # The sampled last token and the observation (but its last token) are prefilled;
            # the earlier turns' K/V stay in the sample's blocks.
            self.waiting.insert(0, seq)
        self.stats.resumed_turns += len(resumed)
        self.pause()
        return bool(self.waiting or self.prefilling or self.running)

    def pause(self) -> None:
        """Hand samples whose turn just ended to the environment; they keep their KV blocks."""
        assert self.exchange is not None, "pause() without a TurnHandler"
        self.finished = self.exchange.hand_over(self.finished)


def sample_key(seed: int, prompt_id: int, sample_index: int) -> int:
    """Key of a sample's random stream, from (seed, global prompt id, sample index)."""
    group_seed = hash((seed, prompt_id))
    return hash((group_seed, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF

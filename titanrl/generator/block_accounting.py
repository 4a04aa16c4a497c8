"""The KV blocks each sequence holds: its block table over the paged pool.

A context is allocated reusing the cached full prompt blocks (prefix caching), or extended when
a multi-turn sample resumes; a group's samples fork its blocks (shared, reference counted) and
copy a shared block before writing into it (copy-on-write); decode reserves the slot of the
next token, or blocks for several steps ahead, and gives back those a pass did not reach.
Which sequence gets blocks, and which is preempted when they run out, is `scheduler.py`'s call.
A model with sliding-window layers also keeps each sequence's window table (`window_pages.py`).
"""

import math

from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks, block_hashes
from titanrl.generator.sequence import Seq
from titanrl.generator.window_pages import WindowPages


class BlockAccounting:
    """Block tables of the sequences of one `generate` call, over `pool` and its `allocator`."""

    def __init__(
        self, pool: KVCachePool, allocator: BlockAllocator, block_size: int, window: WindowPages | None = None
    ) -> None:
        self.pool = pool
        self.allocator = allocator
        self.block_size = block_size
        self.window = window
        """Sliding-window layers' pages (None: the model has none, every layer reads `pool`)."""

    def fits(self, seq: Seq, num_tokens: int, n_after: int) -> bool:
        """Whether the free blocks hold `seq`'s first `num_tokens` tokens and `n_after` more."""
        blocks = math.ceil(num_tokens / self.block_size) + n_after
        if blocks - len(seq.block_table) > self.allocator.num_free:
            return False
        return self.window is None or blocks - len(seq.window_table) <= self.window.allocator.num_free

    def reserve_context(self, seq: Seq, num_tokens: int, can_wait: bool) -> bool:
        """Blocks for `seq`'s first `num_tokens` tokens. False if they are not free and `seq`
        can wait; OutOfBlocks if it cannot (nothing else would ever free a block)."""
        try:
            if seq.block_table:
                self._extend_context(seq, num_tokens)
            else:
                self._allocate_context(seq, num_tokens)
        except OutOfBlocks:
            if can_wait:
                return False
            raise
        return True

    def _allocate_context(self, seq: Seq, num_tokens: int) -> None:
        """Block table for the first `num_tokens` tokens, reusing cached full prompt blocks."""
        B = self.block_size
        hashes = block_hashes(seq.token_ids[: seq.prompt_len], B)
        # Keep at least one token to compute: its logits start (or resume) the sample.
        max_cached = (num_tokens - 1) // B
        table: list[int] = []
        try:
            for h in hashes[:max_cached]:
                block = self.allocator.lookup(h)
                if block is None:
                    break
                table.append(block)
            if self.window is not None:  # a hit whose window pages are cached too
                keep = self.window.cached_prefix(hashes, len(table))
                for block in table[keep:]:
                    self.allocator.free(block)
                del table[keep:]
            seq.num_computed = len(table) * B
            while len(table) * B < num_tokens:
                table.append(self.pool.prepare(self.allocator.allocate()))
            if self.window is not None:
                self.window.allocate_context(seq, hashes, seq.num_computed // B, num_tokens)
        except OutOfBlocks:
            for block in table:
                self.allocator.free(block)
            seq.num_computed = 0
            raise
        seq.block_table = table

    def _extend_context(self, seq: Seq, num_tokens: int) -> None:
        """A resumed multi-turn sample keeps its blocks; add blocks up to `num_tokens` and make
        the block it writes into first its own (it may still be shared with the group)."""
        B = self.block_size
        first = seq.num_computed // B
        if first < len(seq.block_table) and self.allocator.ref_count[seq.block_table[first]] > 1:
            self._copy_on_write(seq, first)
        while len(seq.block_table) * B < num_tokens:
            self._append_block(seq)
        if self.window is not None:
            self.window.extend(seq, num_tokens)

    def register_prompt_blocks(self, seq: Seq) -> None:
        """Offer `seq`'s computed full prompt blocks to later sequences (prefix caching)."""
        B = self.block_size
        full = min(seq.num_computed, seq.prompt_len) // B
        hashes = block_hashes(seq.token_ids[: full * B], B)
        for block, h in zip(seq.block_table[:full], hashes):
            self.allocator.register(block, h)
        if self.window is not None:
            self.window.register(seq, full, hashes)

    def fork(self, group: Seq, sample_index: int, key: int) -> Seq:
        """Sample `sample_index` of a group, with random stream `key`: the group's blocks shared."""
        return Seq(
            group.prompt_index,
            sample_index,
            list(group.token_ids),
            group.prompt_len,
            group.params,
            key,
            block_table=[self.allocator.fork(b) for b in group.block_table],
            num_computed=group.num_computed,
            route_chunks=None if group.route_chunks is None else list(group.route_chunks),
            window_table=self.window.fork(group) if self.window is not None else [],
        )

    def reserve_slot(self, seq: Seq) -> None:
        """Make the block for the token at position len-1 writable by this sequence alone."""
        B = self.block_size
        pos = len(seq.token_ids) - 1
        if pos // B == len(seq.block_table):
            self._append_block(seq)
        elif self.allocator.ref_count[seq.block_table[pos // B]] > 1:  # shared with the group
            self._copy_on_write(seq, pos // B)
        if self.window is not None:
            self.window.reserve_slot(seq, pos)

    def reserve_steps(self, batch: list[Seq], lefts: list[int], max_steps: int) -> int:
        """Blocks for the next decode steps of every sequence in `batch` (each already has a
        writable slot for its next one, and may take `lefts` more tokens). Returns the number of
        steps reserved: `max_steps` (capped by the largest `lefts`), halved until the free
        blocks cover them (1: the next pass schedules, and preempts, step by step)."""
        B = self.block_size
        steps = min(max_steps, max(lefts))
        while steps > 1:
            # Positions written: len-1 .. len-2+k, k = the steps this sequence may still take.
            last = [len(s.token_ids) - 2 + min(steps, left) for s, left in zip(batch, lefts)]
            needed = [max(0, p // B + 1 - len(s.block_table)) for s, p in zip(batch, last)]
            if sum(needed) <= self.allocator.num_free and _window_fits(self.window, batch, last):
                for seq, n, p in zip(batch, needed, last):
                    for _ in range(n):
                        self._append_block(seq)
                    if self.window is not None:
                        self.window.extend(seq, p + 1)
                return steps
            steps //= 2
        return 1

    def trim(self, seq: Seq) -> None:
        """Give back blocks reserved ahead but not reached (a pass ended early)."""
        keep = (len(seq.token_ids) - 1) // self.block_size + 1
        while len(seq.block_table) > keep:
            self.allocator.free(seq.block_table.pop())
        if self.window is not None:
            self.window.trim(seq, keep)

    def reserve_window_chunk(self, seq: Seq, can_wait: bool) -> bool:
        """Window pages up to `seq.prefill_end`, this step's chunk, and none past it: admission
        reserves the whole context, later chunks take theirs as they come. False if they are
        not free and `seq` can wait; OutOfBlocks if it cannot (the pool leaves room for one)."""
        if self.window is None:
            return True
        self.window.trim(seq, math.ceil(seq.prefill_end / self.block_size))
        try:
            self.window.extend(seq, seq.prefill_end)
        except OutOfBlocks:
            if can_wait:
                return False
            raise
        return True

    def release_behind_window(self, seq: Seq) -> None:
        """Give back the window pages no query from `seq.num_computed` on reads (`window_pages.py`)."""
        if self.window is not None:
            self.window.release_behind(seq)

    def free(self, seq: Seq) -> None:
        """Give back every block `seq` holds."""
        for block in seq.block_table:
            self.allocator.free(block)
        seq.block_table = []
        if self.window is not None:
            self.window.free(seq)

    def _append_block(self, seq: Seq) -> None:
        seq.block_table.append(self.pool.prepare(self.allocator.allocate()))

    def _copy_on_write(self, seq: Seq, index: int) -> None:
        """Give `seq` its own copy of its shared block `block_table[index]`."""
        block = seq.block_table[index]
        new_block = self.pool.prepare(self.allocator.allocate())
        self.pool.copy_block(block, new_block)
        self.allocator.free(block)
        seq.block_table[index] = new_block


def _window_fits(window: WindowPages | None, batch: list[Seq], last: list[int]) -> bool:
    """Whether the window pool (if any) has the pages to cover each sequence up to position `last`."""
    if window is None:
        return True
    needed = [max(0, p // window.block_size + 1 - len(s.window_table)) for s, p in zip(batch, last)]
    return sum(needed) <= window.allocator.num_free

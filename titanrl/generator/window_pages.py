"""Pages of the sliding-window layers (gpt-oss): a pool of their own, released behind the window.

A query at position p of a sliding-window layer sees keys p - window + 1 .. p, so once a
sequence's next query is at `num_computed`, its pages wholly before num_computed - window + 1 are
never read again. These layers keep their K/V in a second pool (`KVCachePool` whose other layers
are empty) with its own allocator, and each sequence a second block table, `Seq.window_table`,
indexed like `block_table` (logical block i holds positions i * B .. i * B + B - 1): a page behind
the window goes back to the allocator and its entry becomes `RELEASED`, which attention reads as
the scratch block (masked out: the window mask never reaches it). Between scheduler passes a
decoding sequence, or one between two chunks of its prefill (each chunk takes its window pages
as it comes; admission checks the whole context fits), so holds at most ceil(window / B) + 1
window pages. Full-attention layers keep every page in the main pool, as for any other model.

Prefix caching covers both pools: the window pool's full prompt pages are registered under the
same hashes, and a prefix hit of k blocks needs only the window pages its first computed query
sees (blocks of positions k * B - window + 1 .. k * B - 1); the hit is shortened until they are
cached too. Shared pages are reference counted in each pool: releasing drops one reference.
"""

import math

import torch

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks
from titanrl.generator.sequence import Seq
from titanrl.models.args import TransformerModelArgs

RELEASED = -1
"""A `Seq.window_table` entry whose page was given back (wholly behind the window)."""


def sliding_layers(args: TransformerModelArgs) -> list[bool]:
    """Whether each block is a sliding-window layer."""
    return [args.layer_window(i) > 0 for i in range(args.n_layers)]


def kv_layers(args: TransformerModelArgs, in_window_pool: bool) -> list[bool]:
    """The layers whose K/V the window pool (`in_window_pool`) or the main pool holds: without
    a sliding layer there is no window pool and every attention layer is in the main one."""
    sliding = sliding_layers(args) if args.sliding_window else [False] * args.n_layers
    return [s == in_window_pool and not args.is_linear_layer(i) for i, s in enumerate(sliding)]


def window_pool_blocks(args: TransformerModelArgs, config: GeneratorConfig, num_blocks: int) -> int:
    """Pages of the window pool beside a main pool of `num_blocks` (0: no sliding layer): every
    sequence's window (ceil(window / B) + 1 pages) plus the pages a decode pass reserves ahead,
    and one whole context (a prefill in one piece writes its whole context before the pages
    behind the window go back); never more than the main pool's."""
    if not any(kv_layers(args, in_window_pool=True)):
        return 0
    B = config.block_size
    per_seq = math.ceil(args.sliding_window / B) + 1 + math.ceil(config.decode_steps_per_schedule / B)
    return min(num_blocks, config.max_num_seqs * per_seq + math.ceil(args.max_seq_len / B))


def build_window_pages(
    args: TransformerModelArgs,
    config: GeneratorConfig,
    num_blocks: int,
    main_pool: KVCachePool,
    kv_dims: tuple[int, int, bool],
    dtype: torch.dtype,
    device: torch.device,
) -> "WindowPages":
    """The window pool of `num_blocks` pages (and one scratch block) beside `main_pool`, each
    token's entry `kv_dims` (heads, head dim, latent), and its allocator (prefix caching as
    configured)."""
    heads, head_dim, latent = kv_dims
    layers = kv_layers(args, in_window_pool=True)
    B = config.block_size
    pool = KVCachePool(
        args.n_layers, num_blocks + 1, B, heads, head_dim, dtype, device, kv_layers=layers, latent=latent
    )
    allocator = BlockAllocator(num_blocks, config.enable_prefix_caching)
    return WindowPages(pool, allocator, args.sliding_window, main_pool, layers)


class WindowPages:
    """The sliding-window layers' pool and allocator, and the window tables of the sequences."""

    def __init__(
        self, pool: KVCachePool, allocator: BlockAllocator, window: int, main_pool: KVCachePool, sliding: list[bool]
    ) -> None:
        self.pool = pool
        self.allocator = allocator
        self.window = window
        self.block_size = pool.block_size
        self.scratch = pool.num_blocks - 1
        # Each layer's page tensors, in the window pool for a sliding layer (`sliding`), else the main one.
        self.k = [w if s else m for s, w, m in zip(sliding, pool.k, main_pool.k, strict=True)]
        self.v = [w if s else m for s, w, m in zip(sliding, pool.v, main_pool.v, strict=True)]

    def table(self, seq: Seq) -> list[int]:
        """`seq`'s window table for attention: released pages read as the scratch block."""
        return [self.scratch if b == RELEASED else b for b in seq.window_table]

    def held(self, seq: Seq) -> int:
        """Window pages `seq` holds."""
        return sum(b != RELEASED for b in seq.window_table)

    def first_needed(self, next_pos: int) -> int:
        """The first logical block a query at `next_pos` or later still reads."""
        return max(0, next_pos - self.window + 1) // self.block_size

    def cached_prefix(self, hashes: list[int], num_hits: int) -> int:
        """The longest prefix hit <= `num_hits` blocks whose window pages are cached too."""
        for k in range(num_hits, 0, -1):
            if all(self.allocator.is_cached(h) for h in hashes[self.first_needed(k * self.block_size) : k]):
                return k
        return 0

    def allocate_context(self, seq: Seq, hashes: list[int], num_hits: int, num_tokens: int) -> None:
        """`seq`'s window table for its first `num_tokens` tokens after a prefix hit of
        `num_hits` blocks (`cached_prefix`): the hit's pages behind the window are not taken."""
        first = self.first_needed(num_hits * self.block_size)
        table = [RELEASED] * first
        try:
            for h in hashes[first:num_hits]:
                block = self.allocator.lookup(h)
                assert block is not None, "cached_prefix checked the window pages are cached"
                table.append(block)
            while len(table) * self.block_size < num_tokens:
                table.append(self.pool.prepare(self.allocator.allocate()))
        except OutOfBlocks:
            _free_all(self.allocator, table)
            raise
        seq.window_table = table

    def extend(self, seq: Seq, num_tokens: int) -> None:
        """A resumed sample's window table up to `num_tokens`, its first written page its own."""
        first = seq.num_computed // self.block_size
        if first < len(seq.window_table) and self.allocator.ref_count[seq.window_table[first]] > 1:
            self._copy_on_write(seq, first)
        while len(seq.window_table) * self.block_size < num_tokens:
            self._append(seq)

    def register(self, seq: Seq, full: int, hashes: list[int]) -> None:
        """Offer the held pages of `seq`'s first `full` (computed, prompt) blocks to prefix caching."""
        for block, h in zip(seq.window_table[:full], hashes):
            if block != RELEASED:
                self.allocator.register(block, h)

    def fork(self, group: Seq) -> list[int]:
        """A sample's window table: its group's pages shared."""
        return [b if b == RELEASED else self.allocator.fork(b) for b in group.window_table]

    def reserve_slot(self, seq: Seq, pos: int) -> None:
        """Make the window page of position `pos` writable by `seq` alone."""
        index = pos // self.block_size
        if index == len(seq.window_table):
            self._append(seq)
        elif self.allocator.ref_count[seq.window_table[index]] > 1:
            self._copy_on_write(seq, index)

    def trim(self, seq: Seq, keep: int) -> None:
        """Give back the pages past the first `keep` blocks (reserved ahead, not reached)."""
        while len(seq.window_table) > keep:
            block = seq.window_table.pop()
            if block != RELEASED:
                self.allocator.free(block)

    def release_behind(self, seq: Seq) -> None:
        """Give back `seq`'s pages that no query from `num_computed` on reads."""
        for i in range(min(self.first_needed(seq.num_computed), len(seq.window_table))):
            if seq.window_table[i] != RELEASED:
                self.allocator.free(seq.window_table[i])
                seq.window_table[i] = RELEASED

    def free(self, seq: Seq) -> None:
        _free_all(self.allocator, seq.window_table)
        seq.window_table = []

    def _append(self, seq: Seq) -> None:
        seq.window_table.append(self.pool.prepare(self.allocator.allocate()))

    def _copy_on_write(self, seq: Seq, index: int) -> None:
        block = seq.window_table[index]
        new_block = self.pool.prepare(self.allocator.allocate())
        self.pool.copy_block(block, new_block)
        self.allocator.free(block)
        seq.window_table[index] = new_block


def _free_all(allocator: BlockAllocator, table: list[int]) -> None:
    """Drop a reference to each held page of `table`."""
    for block in table:
        if block != RELEASED:
            allocator.free(block)

"""Paged KV cache: a pool of fixed-size blocks for every layer, and its allocator.

A sequence owns a block table (list of block ids); token t lives in block table[t // B] at
offset t % B. Blocks are ref-counted so that the samples of a group, and prompts with a common
prefix, share them. A full block whose tokens are known is registered under a hash of its
tokens and of all tokens before it (prefix caching); when its last user lets go it stays cached,
evictable in LRU order, until its block is needed for something else.
"""

import os
from collections import OrderedDict

import torch


class OutOfBlocks(Exception):
    """No free or evictable block is left (the scheduler preempts a sequence and retries)."""


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest id
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        # Cached blocks nobody references, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (free, or cached and unreferenced)."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
        else:
            raise OutOfBlocks()
        assert self.ref_count[block] == 0
        self.ref_count[block] = 1
        return block

    def fork(self, block: int) -> int:
        """Another reference to `block` (a sample sharing its group's prompt)."""
        assert self.ref_count[block] > 0, f"fork of unreferenced block {block}"
        self.ref_count[block] += 1
        return block

    def free(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"double free of block {block}"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self._hash_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def lookup(self, block_hash: int) -> int | None:
        """The cached block with this hash, now referenced by the caller, or None."""
        block = self._block_of_hash.get(block_hash) if self.enable_prefix_caching else None
        if block is None:
            return None
        if self.ref_count[block] == 0:
            del self._evictable[block]
        self.ref_count[block] += 1
        return block

    def is_cached(self, block_hash: int) -> bool:
        """Whether `lookup` would find a block with this hash."""
        return self.enable_prefix_caching and block_hash in self._block_of_hash

    def register(self, block: int, block_hash: int) -> None:
        """Mark a full, computed block as reusable under `block_hash`."""
        if not self.enable_prefix_caching or block in self._hash_of_block:
            return
        if block_hash in self._block_of_hash:
            return  # an identical block is already cached; this one stays private
        self._hash_of_block[block] = block_hash
        self._block_of_hash[block_hash] = block

    def reset_prefix_cache(self, live: bool = False) -> None:
        """Forget every cached block (after a weight update their K/V are stale). `live`: samples
        in flight may hold blocks (a stream's weight swap); theirs stay theirs, uncached."""
        assert live or all(rc == 0 for rc in self.ref_count), "prefix cache reset while sequences hold blocks"
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of_block.clear()
        self._block_of_hash.clear()

    def check_invariants(self) -> None:
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable
        for block in range(self.num_blocks):
            rc = self.ref_count[block]
            assert rc >= 0
            if rc > 0:
                assert block not in free and block not in evictable, f"block {block} in use but free"
            else:
                assert (block in free) != (block in evictable), f"block {block} leaked"
                assert (block in evictable) == (block in self._hash_of_block)
        for h, b in self._block_of_hash.items():
            assert self._hash_of_block[b] == h


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hash of each full block, chained with the hash of everything before it."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class KVCachePool:
    """K and V tensors of every layer, each [num_blocks, block_size, n_kv_heads, head_dim]
    (a page is a block; token t of a sequence lives at slot table[t // B] * B + t % B of the
    flattened [num_blocks * block_size, n_kv_heads, head_dim] view that attention reads).

    The tensors start uninitialised (no page is touched, so waking the generator costs nothing
    up front); a block is zeroed the first time it is handed out (`prepare`). Zero, not stale
    garbage, matters: slots past a sequence's end are read with weight 0, and 0 * NaN = NaN.
    The last block is the scratch block padding rows write into. `zero_all` zeroes the whole
    pool at once, for attention paths that read every page (FlexAttention over the pool).

    `latent` (multi-head latent attention, `models/mla.py`): one tensor a layer holds each
    token's latent, both the K and the V that attention reads (`v` is `k`, no memory of its own).
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zero_all: bool = False,
        kv_layers: list[bool] | None = None,
        latent: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        alloc = torch.zeros if zero_all else torch.empty
        # `kv_layers` (hybrid models): False for a layer without KV (linear attention keeps a
        # state slot instead), which gets an empty [num_blocks, block_size, 0, head_dim] page tensor.
        kv_layers = kv_layers if kv_layers is not None else [True] * n_layers
        shapes = [(num_blocks, block_size, n_kv_heads if has_kv else 0, head_dim) for has_kv in kv_layers]
        self.k = [alloc(shape, dtype=dtype, device=device) for shape in shapes]
        # MLA (`latent`): one latent per token is both key and value (`models/mla.py`).
        self.latent = latent
        self.v = self.k if latent else [alloc(shape, dtype=dtype, device=device) for shape in shapes]
        self._zeroed = [zero_all] * num_blocks
        self.prepare(num_blocks - 1)

    def write(self, layer_id: int, slot_N: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> None:
        """Store the K/V of N tokens at pool slots (block * block_size + offset)."""
        write_kv(self.k[layer_id], self.v[layer_id], slot_N, k_NHD, v_NHD)

    def gather(self, layer_id: int, slots_SL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [S, L, n_kv_heads, head_dim] at pool slots `slots_SL` (a copy)."""
        return gather_kv(self.k[layer_id], self.v[layer_id], slots_SL)

    def prepare(self, block: int) -> int:
        """Zero `block` if it was never used since the pool was allocated; returns it."""
        if not self._zeroed[block]:
            for t in self.k if self.latent else self.k + self.v:
                t[block].zero_()
            self._zeroed[block] = True
        return block

    @staticmethod
    def bytes_per_block(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, latent: bool = False
    ) -> int:
        """Bytes of one block over all layers: K and V, or the latent alone (`latent`)."""
        return (
            (1 if latent else 2)
            * n_layers
            * block_size
            * n_kv_heads
            * head_dim
            * torch.empty(0, dtype=dtype).element_size()
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k if self.latent else self.k + self.v))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: give a sample its own copy of a shared, partly filled block."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            if not self.latent:
                v[dst].copy_(v[src])


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, slot_N: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor
) -> None:
    """`KVCachePool.write` on one layer's page tensors (also used inside the compiled decode step)."""
    k_pages.view(-1, *k_pages.shape[2:])[slot_N] = k_NHD.to(k_pages.dtype)
    v_pages.view(-1, *v_pages.shape[2:])[slot_N] = v_NHD.to(v_pages.dtype)


def rows_of(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`pool[index]` along the first dimension, as index_select: a copy per row, where advanced
    indexing computes every element's offset."""
    return pool.index_select(0, index.reshape(-1)).view(*index.shape, *pool.shape[1:])


def gather_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, slots_SL: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KVCachePool.gather` on one layer's page tensors."""
    return rows_of(k_pages.view(-1, *k_pages.shape[2:]), slots_SL), rows_of(
        v_pages.view(-1, *v_pages.shape[2:]), slots_SL
    )


def blocks_from_memory(device: torch.device, fraction: float, bytes_per_block: int, reserved_bytes: int = 0) -> int:
    """How many KV blocks `fraction` of the device's free memory holds, less `reserved_bytes`
    (a hybrid model's recurrent-state slots, which share the budget). Rounded down to 4
    significant bits (at most 12.5% less): the pool's size is a static shape of the compiled
    steps, so a restarted job whose free memory moved a little finds its compiled code in the
    cache instead of compiling again."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n = max(1, (int(free_bytes * fraction) - reserved_bytes) // bytes_per_block)
    return n & ~((1 << max(0, n.bit_length() - 4)) - 1)

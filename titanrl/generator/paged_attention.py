"""Attention over block tables for a packed batch of new tokens (prefill chunks and decodes).

The new tokens of all sequences in a step are packed in one row [1, N]. Each layer writes their
k/v into the pool at `slot_mapping`, then every sequence attends from its new tokens to all of
its cached tokens, gathered through its block table. This is the portable path (gather + SDPA),
correct on any device. `impl="flex"` is the fast path for GPUs: FlexAttention over the whole
pool with a block mask whose KV blocks are the pages, so only a sequence's own pages are read
(on CPU it runs FlexAttention's eager reference: correct, not fast).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titanrl.generator.kv_cache import KVCachePool
from titanrl.models.batch_invariant import attend_exact_batched


@dataclass
class SeqSlice:
    """One sequence's part of a step: `num_new` tokens ending at context length `context_len`."""

    block_table: list[int]
    context_len: int
    num_new: int


class PagedAttention:
    """An `AttentionBackend` for one forward step; built by the generator from `SeqSlice`s.

    `exact=True` attends one query at a time with `attend_exact` (batch-invariant mode);
    `impl` picks "sdpa" (gather + SDPA, portable) or "flex" (FlexAttention over the pages).
    """

    def __init__(
        self,
        pool: KVCachePool,
        seqs: list[SeqSlice],
        device: torch.device,
        exact: bool = False,
        impl: str = "sdpa",
    ) -> None:
        if impl not in ("sdpa", "flex"):
            raise ValueError(f"attention impl must be 'sdpa' or 'flex', got '{impl}'")
        self.pool = pool
        self.exact = exact
        self.impl = impl
        self.seqs = seqs
        B = pool.block_size
        max_blocks = max(len(s.block_table) for s in seqs)
        # One host->device copy of all metadata, then index arithmetic on tensors. Short block
        # tables are padded with the scratch block (always zeroed; masked out anyway).
        pad = pool.num_blocks - 1
        meta = torch.tensor(
            [[s.context_len, s.num_new, *s.block_table, *[pad] * (max_blocks - len(s.block_table))] for s in seqs],
            dtype=torch.long,
        ).to(device)
        context_len_S, num_new_S, block_table_SM = meta[:, 0], meta[:, 1], meta[:, 2:]
        max_ctx = int(max(s.context_len for s in seqs))
        max_new = int(max(s.num_new for s in seqs))
        key_pos_L = torch.arange(max_ctx, device=device)
        self.gather_slots_SL = block_table_SM[:, key_pos_L // B] * B + key_pos_L % B
        q_off_Q = torch.arange(max_new, device=device)
        query_pos_SQ = (context_len_S - num_new_S)[:, None] + q_off_Q[None, :]
        query_valid_SQ = q_off_Q[None, :] < num_new_S[:, None]
        starts_S = torch.cumsum(num_new_S, 0) - num_new_S
        self.num_tokens = sum(s.num_new for s in seqs)
        # Pure decode (one new token per sequence): queries and outputs need no re-packing.
        self.decode_only = max_new == 1
        self.query_index_SQ = torch.where(query_valid_SQ, starts_S[:, None] + q_off_Q[None, :], 0)
        # Where each (sequence, query) row goes in the packed output; padding rows go to a spare
        # row N, so that no data-dependent boolean indexing happens in the forward (compile-friendly).
        self.scatter_index_SQ = torch.where(query_valid_SQ, self.query_index_SQ, self.num_tokens)
        valid_pos_SQ = torch.where(query_valid_SQ, query_pos_SQ, 0)
        # Packed order is sequence-major, as the valid (s, q) pairs come out of boolean masking.
        self.slot_mapping_N = self.gather_slots_SL.gather(1, valid_pos_SQ)[query_valid_SQ]
        self.positions_1N = query_pos_SQ[query_valid_SQ].unsqueeze(0)
        # Causal within the sequence, and only its own keys.
        mask_SQL = (key_pos_L[None, None, :] <= query_pos_SQ[:, :, None]) & (
            key_pos_L[None, None, :] < context_len_S[:, None, None]
        )
        self.mask_S1QL = mask_SQL.unsqueeze(1)
        if impl == "flex" and not exact:
            self.block_mask = self._page_block_mask(block_table_SM, num_new_S, device)

    def _page_block_mask(self, block_table_SM: torch.Tensor, num_new_S: torch.Tensor, device) -> BlockMask:
        """Query token n may see pool slot j iff j is in a page of n's sequence at a position <= n's."""
        B = self.pool.block_size
        S = block_table_SM.shape[0]
        q_seq_N = torch.repeat_interleave(torch.arange(S, device=device), num_new_S)
        q_pos_N = self.positions_1N[0]
        # logical_SP[s, page] = index of `page` in s's block table, or -1 if s does not own it.
        logical_SP = torch.full((S, self.pool.num_blocks), -1, dtype=torch.long, device=device)
        for i, s in enumerate(self.seqs):
            logical_SP[i, block_table_SM[i, : len(s.block_table)]] = torch.arange(len(s.block_table), device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            logical = logical_SP[q_seq_N[q_idx], kv_idx // B]
            return (logical >= 0) & (logical * B + kv_idx % B <= q_pos_N[q_idx])

        return create_block_mask(
            mask_mod, None, None, self.num_tokens, self.pool.num_blocks * B, device=device, BLOCK_SIZE=(128, B)
        )

    def attend(self, layer_id: int, q_1NHD: torch.Tensor, k_1NHD: torch.Tensor, v_1NHD: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer_id, self.slot_mapping_N, k_1NHD[0], v_1NHD[0])
        if self.exact:
            return self._attend_exact(q_1NHD[0], layer_id).unsqueeze(0)
        if self.impl == "flex":
            k_cache = self.pool.k[layer_id].view(-1, *k_1NHD.shape[2:])
            v_cache = self.pool.v[layer_id].view(-1, *v_1NHD.shape[2:])
            out_1HND = flex_attention(
                q_1NHD.transpose(1, 2),
                k_cache.unsqueeze(0).transpose(1, 2).to(q_1NHD.dtype),
                v_cache.unsqueeze(0).transpose(1, 2).to(q_1NHD.dtype),
                block_mask=self.block_mask,
                enable_gqa=q_1NHD.shape[2] != k_cache.shape[1],
            )
            return out_1HND.transpose(1, 2)
        k_SLHD, v_SLHD = self.pool.gather(layer_id, self.gather_slots_SL)
        q_SQHD = q_1NHD[0].unsqueeze(1) if self.decode_only else q_1NHD[0][self.query_index_SQ]
        k_SLHD, v_SLHD = k_SLHD.to(q_SQHD.dtype), v_SLHD.to(q_SQHD.dtype)
        out_SHQD = F.scaled_dot_product_attention(
            q_SQHD.transpose(1, 2),
            k_SLHD.transpose(1, 2),
            v_SLHD.transpose(1, 2),
            attn_mask=self.mask_S1QL,
            enable_gqa=q_SQHD.shape[2] != k_SLHD.shape[2],
        )
        out_SQHD = out_SHQD.transpose(1, 2)
        if self.decode_only:
            return out_SQHD.transpose(0, 1)
        N = q_1NHD.shape[1]
        out_NHD = q_1NHD.new_zeros(N + 1, *out_SQHD.shape[2:])
        out_NHD[self.scatter_index_SQ.flatten()] = out_SQHD.flatten(0, 1)
        return out_NHD[:N].unsqueeze(0)

    def _attend_exact(self, q_NHD: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Batch-invariant attention of every (sequence, query) at once (`attend_exact_batched`)."""
        pos_SQ = self.positions_1N[0][self.query_index_SQ]  # padding queries: any real position
        k_SLHD, v_SLHD = self.pool.gather(layer_id, self.gather_slots_SL)
        out_SQHD = attend_exact_batched(q_NHD[self.query_index_SQ], k_SLHD, v_SLHD, pos_SQ)
        if self.decode_only:
            return out_SQHD[:, 0]
        out_NHD = q_NHD.new_zeros(q_NHD.shape[0] + 1, *q_NHD.shape[1:])
        out_NHD[self.scatter_index_SQ.flatten()] = out_SQHD.flatten(0, 1)
        return out_NHD[:-1]

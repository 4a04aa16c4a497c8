"""Attention over block tables for a packed batch of new tokens (prefill chunks and decodes).

The new tokens of all sequences in a step are packed in one row [1, N]. Each layer writes their
k/v into the pool at `slot_mapping`, then every sequence attends from its new tokens to all of
its cached tokens, gathered through its block table. This is the portable path (gather + SDPA),
correct on any device.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanrl.generator.kv_cache import KVCachePool
from titanrl.models.batch_invariant import attend_exact


@dataclass
class SeqSlice:
    """One sequence's part of a step: `num_new` tokens ending at context length `context_len`."""

    block_table: list[int]
    context_len: int
    num_new: int


class PagedAttention:
    """An `AttentionBackend` for one forward step; built by the generator from `SeqSlice`s.

    `exact=True` attends one query at a time with `attend_exact` (batch-invariant mode).
    """

    def __init__(self, pool: KVCachePool, seqs: list[SeqSlice], device: torch.device, exact: bool = False) -> None:
        self.pool = pool
        self.exact = exact
        self.seqs = seqs
        B = pool.block_size
        S = len(seqs)
        max_ctx = max(s.context_len for s in seqs)
        max_new = max(s.num_new for s in seqs)
        gather_slots_SL = torch.zeros(S, max_ctx, dtype=torch.long)
        key_len_S = torch.zeros(S, dtype=torch.long)
        query_index_SQ = torch.zeros(S, max_new, dtype=torch.long)
        query_pos_SQ = torch.zeros(S, max_new, dtype=torch.long)
        query_valid_SQ = torch.zeros(S, max_new, dtype=torch.bool)
        slot_mapping = []
        offset = 0
        for i, s in enumerate(seqs):
            table = torch.tensor(s.block_table, dtype=torch.long)
            pos = torch.arange(s.context_len)
            slots = table[pos // B] * B + pos % B
            gather_slots_SL[i, : s.context_len] = slots
            key_len_S[i] = s.context_len
            new_pos = pos[s.context_len - s.num_new :]
            slot_mapping.append(slots[s.context_len - s.num_new :])
            query_index_SQ[i, : s.num_new] = torch.arange(offset, offset + s.num_new)
            query_pos_SQ[i, : s.num_new] = new_pos
            query_valid_SQ[i, : s.num_new] = True
            offset += s.num_new
        self.num_tokens = offset
        self.slot_mapping_N = torch.cat(slot_mapping).to(device)
        self.gather_slots_SL = gather_slots_SL.to(device)
        self.query_index_SQ = query_index_SQ.to(device)
        # Where each (sequence, query) row goes in the packed output; padding rows go to a spare
        # row N, so that no data-dependent boolean indexing is needed (compile-friendly).
        self.scatter_index_SQ = torch.where(query_valid_SQ, query_index_SQ, offset).to(device)
        key_pos_L = torch.arange(max_ctx)
        # Causal within the sequence, and only its own keys.
        mask_SQL = (key_pos_L[None, None, :] <= query_pos_SQ[:, :, None]) & (
            key_pos_L[None, None, :] < key_len_S[:, None, None]
        )
        self.mask_S1QL = mask_SQL.unsqueeze(1).to(device)
        self.positions_1N = torch.cat(
            [query_pos_SQ[i, : s.num_new] for i, s in enumerate(seqs)]
        ).unsqueeze(0).to(device)

    def attend(self, layer_id: int, q_1NHD: torch.Tensor, k_1NHD: torch.Tensor, v_1NHD: torch.Tensor) -> torch.Tensor:
        k_cache = self.pool.k[layer_id].view(-1, *k_1NHD.shape[2:])
        v_cache = self.pool.v[layer_id].view(-1, *v_1NHD.shape[2:])
        k_cache[self.slot_mapping_N] = k_1NHD[0].to(k_cache.dtype)
        v_cache[self.slot_mapping_N] = v_1NHD[0].to(v_cache.dtype)
        if self.exact:
            return self._attend_exact(q_1NHD[0], k_cache, v_cache).unsqueeze(0)
        q_SQHD = q_1NHD[0][self.query_index_SQ]
        k_SLHD = k_cache[self.gather_slots_SL].to(q_SQHD.dtype)
        v_SLHD = v_cache[self.gather_slots_SL].to(q_SQHD.dtype)
        out_SHQD = F.scaled_dot_product_attention(
            q_SQHD.transpose(1, 2),
            k_SLHD.transpose(1, 2),
            v_SLHD.transpose(1, 2),
            attn_mask=self.mask_S1QL,
            enable_gqa=q_SQHD.shape[2] != k_SLHD.shape[2],
        )
        out_SQHD = out_SHQD.transpose(1, 2)
        N = q_1NHD.shape[1]
        out_NHD = q_1NHD.new_zeros(N + 1, *out_SQHD.shape[2:])
        out_NHD[self.scatter_index_SQ.flatten()] = out_SQHD.flatten(0, 1)
        return out_NHD[:N].unsqueeze(0)

    def _attend_exact(self, q_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, s in enumerate(self.seqs):
            slots = self.gather_slots_SL[i, : s.context_len]
            q_QHD = q_NHD[self.query_index_SQ[i, : s.num_new]]
            positions = list(range(s.context_len - s.num_new, s.context_len))
            outs.append(attend_exact(q_QHD, k_cache[slots], v_cache[slots], positions))
        return torch.cat(outs)

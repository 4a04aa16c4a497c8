"""Attention over block tables: the generator's attention backends.

Every forward of the generator (a prefill of packed new tokens, a one-step decode, a step of the
on-device decode loop) is described by a `PagedBatch`: S sequences, each with its block table
(padded with the scratch block) and the positions of its Q new tokens. Each layer writes the new
tokens' K/V into the pool at their slots, then each query attends to its sequence's positions up
to its own.

- `FlexPagedAttention` (the default on CUDA; on CPU in the compiled decode step): FlexAttention
  over the pool, compiled. Its block mask is built on device from the block tables: the KV blocks
  are pages, query block k of sequence s visits the first `kv_num[s, k]` pages of s's table (the
  table itself is `kv_indices`: no mask over the pool, no loop over sequences), and a mask_mod
  keeps the keys of s's own pages at positions up to the query's. Grouped-query attention folds the R query heads
  of a KV head into the query dimension (R queries of one head at one position), so one program
  reads a page once for its R heads and short queries take the flash-decoding (split-KV) kernel
  whatever the head ratio.
- `GatheredPagedAttention`: each sequence's pages gathered into a copy. `exact=True` is the
  batch-invariant attention (`attend_exact_batched`, the trainer's reduction order); otherwise
  SDPA: the eager CPU path (plain PyTorch, no compiler), and the tests' oracle.

A model with sliding-window layers keeps their K/V in a pool of its own (`window_pages.py`):
those layers attend with `window_batch`, the same queries over the sequences' window tables.
"""

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, FlexKernelOptions, flex_attention

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator.kv_cache import gather_kv, write_kv
from titanrl.models.batch_invariant import attend_exact_batched
from titanrl.models.gated_deltanet import LinearStates
from titanrl.models.gpt_oss import renormalize_with_sinks, sink_softmax_attention, visible_keys

AttentionKind = Literal["flex", "exact", "gathered"]
Q_BLOCK = 128
"""Rows of a query block of the block mask (folded rows: a token's R query heads are R rows)."""


@dataclass
class SeqSlice:
    """One sequence's part of a step: `num_new` tokens ending at context length `context_len`."""

    block_table: list[int]
    context_len: int
    num_new: int
    state_slot: int = -1
    """Hybrid models: the sequence's recurrent-state slot (`state_slots.py`); -1: none / scratch."""


@dataclass
class PagedBatch:
    """The device tensors of one forward over the pool (see the module docstring)."""

    table_SM: torch.Tensor
    """Block tables [S, M], padded with the scratch block (M >= 2: off the 0/1 specialisation)."""
    pos_SQ: torch.Tensor
    """Position of each sequence's q-th new token; padding queries repeat its last one."""
    num_new_S: torch.Tensor
    slot_N: torch.Tensor
    """Pool slot (block * block_size + offset) each packed new token's K/V is written to."""
    positions_1N: torch.Tensor
    scratch: int
    """The scratch block: padding of the tables, K/V writes of dead rows."""
    page_index_P: torch.Tensor | None = None
    """FlexAttention: each page's logical index in the tables that hold it (`logical_page_index`)."""
    query_index_SQ: torch.Tensor | None = None
    """Packed index of query (s, q); None when every sequence has one new token (packed = s)."""
    scatter_index_SQ: torch.Tensor | None = None
    """... and where its output goes: padding queries to a spare row N."""

    @classmethod
    def from_slices(
        cls, seqs: list[SeqSlice], scratch: int, block_size: int, device: torch.device, num_pages: int | None = None
    ) -> "PagedBatch":
        """The packed new tokens of `seqs`, sequence-major; one host->device copy of the metadata.
        `num_pages` (the pool's, FlexAttention only): also the pages' logical indices."""
        B = block_size
        M = max(2, *(len(s.block_table) for s in seqs))
        meta = torch.tensor(
            [[s.context_len, s.num_new, *s.block_table, *[scratch] * (M - len(s.block_table))] for s in seqs],
            dtype=torch.long,
        ).to(device)
        context_len_S, num_new_S, table_SM = meta[:, 0], meta[:, 1], meta[:, 2:]
        max_new = max(s.num_new for s in seqs)
        q_off_Q = torch.arange(max_new, device=device)
        valid_SQ = q_off_Q[None, :] < num_new_S[:, None]
        pos_SQ = (context_len_S - num_new_S)[:, None] + torch.minimum(q_off_Q[None, :], num_new_S[:, None] - 1)
        slot_SQ = table_SM.gather(1, pos_SQ // B) * B + pos_SQ % B
        batch = cls(table_SM, pos_SQ, num_new_S, slot_SQ[valid_SQ], pos_SQ[valid_SQ].unsqueeze(0), scratch)
        if num_pages is not None:
            batch.page_index_P = logical_page_index(table_SM, scratch, num_pages)
        if max_new > 1:
            starts_S = torch.cumsum(num_new_S, 0) - num_new_S
            batch.query_index_SQ = torch.where(valid_SQ, starts_S[:, None] + q_off_Q[None, :], 0)
            num_tokens = sum(s.num_new for s in seqs)
            batch.scatter_index_SQ = torch.where(valid_SQ, batch.query_index_SQ, num_tokens)
        return batch

    @classmethod
    def decode(
        cls,
        table_NM: torch.Tensor,
        pos_N: torch.Tensor,
        live_N: torch.Tensor,
        scratch: int,
        block_size: int,
        page_index_P: torch.Tensor | None,
    ) -> "PagedBatch":
        """A decode step on device: row n feeds one token at `pos_N[n]`; dead rows write the
        scratch block. `page_index_P`: `logical_page_index` of the pass's tables (FlexAttention)."""
        B, M = block_size, table_NM.shape[1]
        slot_N = table_NM.gather(1, (pos_N // B).clamp(max=M - 1)[:, None])[:, 0] * B + pos_N % B
        slot_N = torch.where(live_N, slot_N, scratch * B)
        ones_N = torch.ones_like(pos_N)
        return cls(table_NM, pos_N[:, None], ones_N, slot_N, pos_N.unsqueeze(0), scratch, page_index_P)

    def queries(self, q_1NHD: torch.Tensor) -> torch.Tensor:
        """Packed queries [1, N, H, D] -> per sequence [S, Q, H, D]."""
        return q_1NHD[0].unsqueeze(1) if self.query_index_SQ is None else q_1NHD[0][self.query_index_SQ]

    def packed(self, out_SQHD: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Per-sequence outputs [S, Q, H, D] -> packed [1, N, H, D] (padding queries dropped)."""
        if self.scatter_index_SQ is None:
            return out_SQHD.transpose(0, 1)
        # A spare row N takes the padding queries: no data-dependent boolean indexing.
        out_NHD = out_SQHD.new_zeros(num_tokens + 1, *out_SQHD.shape[2:])
        out_NHD[self.scatter_index_SQ.flatten()] = out_SQHD.flatten(0, 1)
        return out_NHD[:num_tokens].unsqueeze(0)


def fold_heads(x_SQHD: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[S, Q, H, D] -> [S, Hkv, Q * R, D]: the R query heads of a KV head as R rows per token."""
    S, Q, H, D = x_SQHD.shape
    R = H // n_kv_heads
    return x_SQHD.view(S, Q, n_kv_heads, R, D).permute(0, 2, 1, 3, 4).reshape(S, n_kv_heads, Q * R, D)


def unfold_heads(x_SGXD: torch.Tensor, Q: int) -> torch.Tensor:
    """The inverse of `fold_heads`."""
    S, G, X, D = x_SGXD.shape
    R = X // Q
    return x_SGXD.view(S, G, Q, R, D).permute(0, 2, 1, 3, 4).reshape(S, Q, G * R, D)


def logical_page_index(table_SM: torch.Tensor, scratch: int, num_pages: int) -> torch.Tensor:
    """[num_pages] int32: the index of each page in the block tables that hold it (0 for the
    scratch block and pages no table holds). A page has one logical index whoever holds it:
    shared pages are a group's prompt blocks or prefix-cache hits, whose hash chains fix their
    position. Computed before the compiled region and handed to it: inductor's CPU FlexAttention
    reads a mask_mod's buffer wrongly when the same graph computes it (torch 2.13)."""
    S, M = table_SM.shape
    m_SM = torch.arange(M, device=table_SM.device, dtype=torch.int32).expand(S, M)
    index_SM = torch.where(table_SM == scratch, 0, m_SM)
    page_index_P = torch.zeros(num_pages, dtype=torch.int32, device=table_SM.device)
    return page_index_P.scatter_(0, table_SM.flatten(), index_SM.flatten())


def page_block_mask(
    batch: PagedBatch, R: int, block_size: int, num_pages: int, pad_to_pool: bool, window: int = 0
) -> BlockMask:
    """The block mask of `batch` over a pool of `num_pages` pages, folded rows (R per token).

    Query block k of sequence s visits the pages of s's table up to the one holding the position
    of its last token (none for a block of padding rows); the mask_mod keeps the keys of pages
    that are s's at their logical index (`batch.page_index_P`) and not after the query: exact on
    its own, as FlexAttention's semantics want (the block mask only skips work). `pad_to_pool`:
    the CPU lowering wants `kv_indices` as wide as the pool (only the first kv_num entries are
    read). `window` > 0 (gpt-oss sliding-window layers): only the last `window` keys up to the
    query, and a query block's pages start at its first query's window (reads bounded by it)."""
    B, (S, M), Q = block_size, batch.table_SM.shape, batch.pos_SQ.shape[1]
    device = batch.table_SM.device
    rows = Q * R
    first_row_K = torch.arange(0, rows, Q_BLOCK, device=device)
    last_tok_K = (first_row_K + Q_BLOCK).clamp(max=rows).sub(1) // R
    last_tok_SK = torch.minimum(last_tok_K[None, :], batch.num_new_S[:, None] - 1)
    reach_SK = batch.pos_SQ.gather(1, last_tok_SK) // B + 1
    kv_num_SK = torch.where((first_row_K // R)[None, :] < batch.num_new_S[:, None], reach_SK, 0)
    kv_indices = batch.table_SM.to(torch.int32)[:, None, None, :].expand(S, 1, len(first_row_K), M)
    if window > 0:  # a query block visits pages from its first query's window start on
        first_tok_SK = torch.minimum((first_row_K // R)[None, :], batch.num_new_S[:, None] - 1)
        start_SK = (batch.pos_SQ.gather(1, first_tok_SK) - window + 1).clamp(min=0) // B
        kv_num_SK = torch.where(kv_num_SK > 0, kv_num_SK - start_SK, 0)
        index_SKM = (start_SK[:, :, None] + torch.arange(M, device=device)).clamp(max=M - 1)
        kv_indices = batch.table_SM.to(torch.int32).gather(1, index_SKM.flatten(1)).view(S, 1, -1, M)
    if pad_to_pool:
        kv_indices = F.pad(kv_indices, (0, num_pages - M))
    page_index_P, pos_SQ, table_SM = batch.page_index_P, batch.pos_SQ, batch.table_SM

    def mask_mod(b, h, q_idx, kv_idx):
        # The mask alone is exact (eager FlexAttention evaluates it on every slot of the pool):
        # the slot's page is sequence b's at the page's logical index, and not after the query.
        page = kv_idx // B
        logical = torch.clamp(page_index_P[page], max=M - 1)
        owned = table_SM[b, logical] == page
        key_pos, q_pos = logical * B + kv_idx % B, pos_SQ[b, torch.clamp(q_idx // R, max=Q - 1)]
        if window > 0:
            return owned & (key_pos <= q_pos) & (key_pos > q_pos - window)
        return owned & (key_pos <= q_pos)

    return BlockMask.from_kv_blocks(
        kv_num_SK.to(torch.int32)[:, None],
        kv_indices,
        BLOCK_SIZE=(Q_BLOCK, B),
        mask_mod=mask_mod,
        seq_lengths=(rows, num_pages * B),
        compute_q_blocks=False,
    )


@functools.cache
def _compiled_flex_attention():
    """FlexAttention compiled on its own, for forwards that run eagerly (prefill): uncompiled, it
    would compute the scores against every slot of the pool."""
    return torch.compile(flex_attention, fullgraph=True)


class FlexPagedAttention:
    """`AttentionBackend` of one forward: FlexAttention over the pages (module docstring). The
    block mask is built at the first layer and shared by all. `pad_to_pool` on CPU (see
    `page_block_mask`). gpt-oss: sinks renormalise the output by its log-sum-exp
    (`renormalize_with_sinks`), and sliding-window layers get a block mask of their own."""

    supports_sinks = True

    linear_states: LinearStates | None = None
    """A hybrid model's state slots for this forward (`ModelRunner.forward`)."""

    caches_kv = True
    """Keeps K/V in the pool: an MLA layer hands it its latent (`models/mla.py`)."""

    def __init__(
        self,
        batch: PagedBatch,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        window_batch: PagedBatch | None = None,
    ) -> None:
        self.batch, self.k_cache, self.v_cache, self.window_batch = batch, k_cache, v_cache, window_batch
        self.block_mask: BlockMask | None = None
        self.window_masks: dict[int, BlockMask] = {}

    def attend(
        self,
        layer_id: int,
        q_1NHD: torch.Tensor,
        k_1NHD: torch.Tensor,
        v_1NHD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        k_pages, v_pages = self.k_cache[layer_id], self.v_cache[layer_id]
        cpu = k_pages.device.type == "cpu"
        if sinks_H is not None and cpu and torch.compiler.is_compiling():
            # Inductor's CPU FlexAttention has no log-sum-exp output (torch 2.13): gathered pages.
            gathered = GatheredPagedAttention(self.batch, self.k_cache, self.v_cache, False, self.window_batch)
            return gathered.attend(layer_id, q_1NHD, k_1NHD, v_1NHD, sinks_H, window)
        # A sliding-window layer's pages are the window pool's, when it has one.
        batch = self.window_batch if window > 0 and self.window_batch is not None else self.batch
        write_kv(k_pages, v_pages, batch.slot_N, k_1NHD[0], v_1NHD[0])
        P, B, Hkv, D = k_pages.shape
        q_SQHD = batch.queries(q_1NHD)
        R = q_SQHD.shape[2] // Hkv
        if window > 0 and window not in self.window_masks:
            self.window_masks[window] = page_block_mask(batch, R, B, P, pad_to_pool=cpu, window=window)
        elif window == 0 and self.block_mask is None:
            self.block_mask = page_block_mask(batch, R, B, P, pad_to_pool=cpu)
        block_mask = self.window_masks[window] if window > 0 else self.block_mask
        assert block_mask is not None, "built above"
        # Triton's tiles must divide the KV block (a page); the CPU kernel picks its own.
        options: FlexKernelOptions | None = {"BLOCK_N": min(B, 64)} if k_pages.device.type == "cuda" else None
        k_1GLD = k_pages.view(1, P * B, Hkv, D).transpose(1, 2)
        v_1GLD = v_pages.view(1, P * B, Hkv, D).transpose(1, 2)
        if torch.compiler.is_compiling() or (cpu and sinks_H is not None):
            flex = flex_attention  # eager on CPU with sinks: the CPU kernel has no log-sum-exp
        else:
            flex = _compiled_flex_attention()
            # The pool's size never varies within a generator; left to automatic dynamic shapes
            # (a new generator's pool), a symbolic one breaks inductor's CPU kernel (torch 2.13).
            for t in (k_pages, v_pages, batch.page_index_P):
                torch._dynamo.mark_static(t)
            if k_pages.device.type == "cpu":  # kv_indices padded to the pool (`page_block_mask`)
                torch._dynamo.mark_static(block_mask.kv_indices, 3)
        args = (fold_heads(q_SQHD, Hkv).to(k_pages.dtype), k_1GLD, v_1GLD)
        if sinks_H is None:
            out_SGXD = flex(*args, block_mask=block_mask, kernel_options=options)
            out_SQHD = unfold_heads(out_SGXD, q_SQHD.shape[1]).to(q_1NHD.dtype)
            return self.batch.packed(out_SQHD, q_1NHD.shape[1])
        out_SGXD, aux = flex(*args, block_mask=block_mask, kernel_options=options, return_aux=AuxRequest(lse=True))
        Q = q_SQHD.shape[1]
        assert aux.lse is not None, "requested by AuxRequest(lse=True)"
        lse_SQH = unfold_heads(aux.lse.unsqueeze(-1), Q)[..., 0]
        out_SQHD = renormalize_with_sinks(unfold_heads(out_SGXD, Q), lse_SQH, sinks_H).to(q_1NHD.dtype)
        return batch.packed(out_SQHD, q_1NHD.shape[1])


class GatheredPagedAttention:
    """`AttentionBackend` of one forward over gathered copies of each sequence's pages: the
    batch-invariant attention (`exact`) or SDPA; gpt-oss layers (sinks, windows): the exact
    attention with both, or the explicit softmax of `sink_softmax_attention`."""

    supports_sinks = True

    linear_states: LinearStates | None = None
    """A hybrid model's state slots for this forward (`ModelRunner.forward`)."""

    caches_kv = True
    """Keeps K/V in the pool: an MLA layer hands it its latent (`models/mla.py`)."""

    def __init__(
        self,
        batch: PagedBatch,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        exact: bool,
        window_batch: PagedBatch | None = None,
    ) -> None:
        self.batch, self.k_cache, self.v_cache, self.exact = batch, k_cache, v_cache, exact
        self.window_batch = window_batch
        self.slots: dict[bool, torch.Tensor] = {}
        """Each sequence's slots [S, L], of its block table (False) or window table (True)."""
        self.visible_SQL: torch.Tensor | None = None

    def attend(
        self,
        layer_id: int,
        q_1NHD: torch.Tensor,
        k_1NHD: torch.Tensor,
        v_1NHD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        k_pages, v_pages = self.k_cache[layer_id], self.v_cache[layer_id]
        in_window_pool = window > 0 and self.window_batch is not None
        batch = self.window_batch if in_window_pool and self.window_batch is not None else self.batch
        write_kv(k_pages, v_pages, batch.slot_N, k_1NHD[0], v_1NHD[0])
        q_SQHD = batch.queries(q_1NHD)
        if in_window_pool not in self.slots:  # at the first layer of each pool, for all
            B, table_SM = k_pages.shape[1], batch.table_SM
            self.slots[in_window_pool] = (table_SM[:, :, None] * B + torch.arange(B, device=table_SM.device)).flatten(1)
        slots_SL = self.slots[in_window_pool]
        k_SLHD, v_SLHD = (t.to(q_SQHD.dtype) for t in gather_kv(k_pages, v_pages, slots_SL))
        if sinks_H is not None or window > 0:
            return self.batch.packed(self.attend_gpt_oss(q_SQHD, k_SLHD, v_SLHD, sinks_H, window), q_1NHD.shape[1])
        if self.exact:
            out_SQHD = attend_exact_batched(q_SQHD, k_SLHD, v_SLHD, self.batch.pos_SQ)
        else:
            Q, Hkv = q_SQHD.shape[1], k_SLHD.shape[2]
            R = q_SQHD.shape[2] // Hkv
            if self.visible_SQL is None:  # at the first layer, for all
                key_pos_L = torch.arange(slots_SL.shape[1], device=slots_SL.device)
                self.visible_SQL = key_pos_L[None, None, :] <= self.batch.pos_SQ[:, :, None]
            out_SGXD = F.scaled_dot_product_attention(
                fold_heads(q_SQHD, Hkv),
                k_SLHD.transpose(1, 2),
                v_SLHD.transpose(1, 2),
                # Rows of a token share its mask: broadcast for one token a sequence (decode).
                attn_mask=(self.visible_SQL if Q == 1 else self.visible_SQL.repeat_interleave(R, dim=1)).unsqueeze(1),
            )
            out_SQHD = unfold_heads(out_SGXD, Q)
        return self.batch.packed(out_SQHD, q_1NHD.shape[1])

    def attend_gpt_oss(
        self,
        q_SQHD: torch.Tensor,
        k_SLHD: torch.Tensor,
        v_SLHD: torch.Tensor,
        sinks_H: torch.Tensor | None,
        window: int,
    ) -> torch.Tensor:
        """Attention with sinks (None: none) over the keys of the last `window` positions (0: all)."""
        if self.exact:
            return attend_exact_batched(q_SQHD, k_SLHD, v_SLHD, self.batch.pos_SQ, sinks_H=sinks_H, window=window)
        if sinks_H is None:
            sinks_H = q_SQHD.new_full((q_SQHD.shape[2],), float("-inf"))
        key_pos_L = torch.arange(k_SLHD.shape[1], device=k_SLHD.device)
        return sink_softmax_attention(
            q_SQHD, k_SLHD, v_SLHD, visible_keys(self.batch.pos_SQ, key_pos_L, window), sinks_H
        )


def attention_kinds(config: GeneratorConfig, device: torch.device, compile: bool) -> tuple[AttentionKind, ...]:
    """The attention of (compiled regions: the decode step and one-step decodes under `compile`,
    eager forwards: prefill and uncompiled decodes). 'exact' where asked for or in batch-invariant
    mode. FlexAttention on CUDA everywhere (eager forwards call it compiled on its own); on CPU
    inside the compiled decode step only: compiled alone under changing prefill shapes, inductor's
    CPU kernel fails to build (torch 2.13: `cpp_flex_attention_template` renames its split-size
    variables by string replacement, and `ks1` -> `cur_kvSplitSize` also hits `ks17`), so eager CPU
    forwards attend over gathered pages, plain PyTorch (no compiler unless `compile` asks)."""
    if config.attention_impl == "exact" or config.batch_invariant:
        return "exact", "exact"
    if config.compile_backend != "inductor":
        return "gathered", "gathered"
    if device.type == "cuda":
        return "flex", "flex"
    return ("flex" if compile else "gathered"), "gathered"


def paged_attention(
    kind: AttentionKind,
    batch: PagedBatch,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    window_batch: PagedBatch | None = None,
) -> FlexPagedAttention | GatheredPagedAttention:
    """The backend of one forward: 'flex', 'exact' (batch-invariant) or 'gathered' (SDPA).
    `window_batch`: the sliding-window layers' batch over their own pool (`window_pages.py`)."""
    if kind == "flex":
        return FlexPagedAttention(batch, k_cache, v_cache, window_batch)
    return GatheredPagedAttention(batch, k_cache, v_cache, kind == "exact", window_batch)

"""Batch-invariant execution: a token's numbers do not depend on which other tokens share its batch.

BLAS picks different kernels, thread splits and summation orders for different matrix shapes, so
the same token gets slightly different logits when the generator decodes it among 3 sequences and
when the trainer scores it among 40 positions. Under `batch_invariant_mode()` (and with
`attend_exact*` / `ExactCausalAttention` for attention) generator and trainer logprobs are bitwise
identical, at a small cost over the ordinary kernels (bench_bitwise in docs/benchmarks.md):

- Linear layers (aten.mm / addmm): the rows are padded to a multiple of `TILE_ROWS` and cut into
  tiles of exactly `TILE_ROWS` rows, all multiplied by the weight in one batched GEMM. Every row
  goes through a GEMM of the same shape [TILE_ROWS, K] x [K, N], whatever the number of rows of
  the call; the GEMM's result for a row depends only on that row and the weight (checked,
  neighbours and position in the tile included, by tests/test_batch_invariant.py).
- Attention reduces over the keys in fixed blocks of `KEY_BLOCK` positions, in order: each block's
  scores and its part of probs @ v are GEMMs of a fixed width, its sum of probabilities a reduction
  of fixed length, and blocks are added one after the other. The max is exact in any order. A
  block holding only keys after the query contributes exact zeros (exp(-inf) = 0), so a query at
  position p gets the same bits whether the batch holds its sequence's full length (the trainer)
  or only its p + 1 cached keys (the generator), and whatever the other sequences are. The rows of
  those GEMMs (the queries of one sequence and key head) are padded to a multiple of
  `ROW_MULTIPLE`: this machine's BLAS (MKL sgemm, oneDNN for bf16) gives a row the same bits for
  any such row count, which the tests check for the shapes attention uses (other aten.bmm calls
  under the mode get the same padding).
- The backward pass is the ordinary one (the mode intercepts below autograd; exact attention's
  backward recomputes plain attention): only forward values need to match.
- Norms, RoPE and the logprob softmax reduce along one row and were row-invariant already.
"""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten

# Rows per GEMM tile of a linear layer. 16 rows cost about what one big GEMM costs on CPU and keep
# the padding of a small decode batch cheap.
TILE_ROWS = 16
# Keys per attention block: the reduction over keys is done block by block, in this fixed width.
KEY_BLOCK = 32
# Attention GEMM rows are padded to a multiple of this (MKL computes rows in groups of 4; counts
# that are not a multiple of 4 can take other kernels for the last rows).
ROW_MULTIPLE = 4


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """`x` with zero rows appended along dim -2 up to a multiple of `multiple` (at least one)."""
    pad = -x.shape[-2] % multiple if x.shape[-2] else multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _mm_invariant(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    M, K = a_MK.shape
    N = b_KN.shape[1]
    # At least two tiles: a one-batch bmm is routed to a plain GEMM, which MKL may split over
    # threads along the reduction (other bits than the batched path, where each tile's GEMM runs
    # on one thread in a fixed order).
    padded_MK = _pad_rows(a_MK, TILE_ROWS) if M > TILE_ROWS else F.pad(a_MK, (0, 0, 0, 2 * TILE_ROWS - M))
    tiles_GTK = padded_MK.reshape(-1, TILE_ROWS, K)
    out_GTN = torch.bmm(tiles_GTK, b_KN.expand(tiles_GTK.shape[0], K, N))
    return out_GTN.view(-1, N)[:M]


def _bmm_invariant(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    M = a_BMK.shape[1]
    return torch.bmm(_pad_rows(a_BMK, ROW_MULTIPLE), b_BKN)[:, :M]


def _plain(t) -> bool:
    return not isinstance(t, torch.Tensor) or type(t) is torch.Tensor


class _BatchInvariantMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default) and not all(map(_plain, args)):
            # A tensor subclass (DTensor under tensor parallelism) runs the ordinary op: its local
            # matmuls do not come back to this mode, so they are not made batch-invariant here.
            return func(*args, **kwargs)
        if func is aten.mm.default:
            return _mm_invariant(*args)
        if func is aten.addmm.default and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            bias, a, b = args
            return _mm_invariant(a, b) + bias
        if func is aten.bmm.default:
            return _bmm_invariant(*args)
        return func(*args, **kwargs)


def batch_invariant_mode() -> TorchDispatchMode:
    """Context manager: `with batch_invariant_mode(): model(...)`."""
    return _BatchInvariantMode()


def in_batch_invariant_mode() -> bool:
    """Whether a `batch_invariant_mode()` is active: ops it does not cover (grouped GEMMs) must
    then take a path made of the ops it does. The mode runs eagerly only, never under compile."""
    if torch.compiler.is_compiling():
        return False
    return any(isinstance(m, _BatchInvariantMode) for m in _get_current_dispatch_mode_stack())


def attend_exact_batched(
    q_SQHD: torch.Tensor, k_SLHD: torch.Tensor, v_SLHD: torch.Tensor, pos_SQ: torch.Tensor
) -> torch.Tensor:
    """Causal attention, batch-invariant: query (s, i) at position `pos_SQ[s, i]` attends to keys
    0..pos of sequence s, where `k_SLHD[s, j]` is the key at position j (entries after a query's
    position are ignored, whatever they hold, if finite). Returns [S, Q, H, D] in q's dtype.

    A query's output depends only on its q, its keys and values up to its position, and its
    position: not on the other queries or sequences, nor on how many keys follow it. Rows of the
    output for padding queries (any position, e.g. 0) are computed and meaningless.
    """
    S, Q, H, D = q_SQHD.shape
    L, Hkv = k_SLHD.shape[1], k_SLHD.shape[2]
    n_rep = H // Hkv
    dtype = q_SQHD.dtype
    # The queries of one sequence and kv head are the rows of its GEMMs: [S, Hkv, R, D].
    R = Q * n_rep
    q_SGRD = _pad_rows(q_SQHD.reshape(S, Q, Hkv, n_rep, D).permute(0, 2, 1, 3, 4).reshape(S, Hkv, R, D), ROW_MULTIPLE)
    Rp = q_SGRD.shape[2]
    pos_SR = F.pad(pos_SQ.repeat_interleave(n_rep, dim=1), (0, Rp - R))
    # Keys padded with zeros to whole blocks: [S, Hkv, Lp, D].
    Lp = -(-L // KEY_BLOCK) * KEY_BLOCK
    k_SGLD = F.pad(k_SLHD.to(dtype).transpose(1, 2), (0, 0, 0, Lp - L))
    v_SGLD = F.pad(v_SLHD.to(dtype).transpose(1, 2), (0, 0, 0, Lp - L))
    scale = D**-0.5
    blocks = range(0, Lp, KEY_BLOCK)
    offsets_C = torch.arange(KEY_BLOCK, device=q_SQHD.device)
    scores = []
    for start in blocks:
        s_SGRC = torch.matmul(q_SGRD, k_SGLD[:, :, start : start + KEY_BLOCK].transpose(-1, -2)).float() * scale
        hidden_S1RC = (start + offsets_C)[None, None, None, :] > pos_SR[:, None, :, None]
        scores.append(s_SGRC.masked_fill_(hidden_S1RC, float("-inf")))
    max_SGR1 = scores[0].amax(-1, keepdim=True)  # key 0 is visible to every query: finite
    for s_SGRC in scores[1:]:
        max_SGR1 = torch.maximum(max_SGR1, s_SGRC.amax(-1, keepdim=True))
    denom_SGR1 = acc_SGRD = None
    for start, s_SGRC in zip(blocks, scores):
        p_SGRC = torch.exp(s_SGRC - max_SGR1)
        block_sum = p_SGRC.sum(-1, keepdim=True)
        block_pv = torch.matmul(p_SGRC.to(dtype), v_SGLD[:, :, start : start + KEY_BLOCK]).float()
        denom_SGR1 = block_sum if denom_SGR1 is None else denom_SGR1 + block_sum
        acc_SGRD = block_pv if acc_SGRD is None else acc_SGRD + block_pv
    assert acc_SGRD is not None and denom_SGR1 is not None, "there is at least one key block"
    out_SGRD = (acc_SGRD / denom_SGR1).to(dtype)[:, :, :R]
    return out_SGRD.reshape(S, Hkv, Q, n_rep, D).permute(0, 2, 1, 3, 4).reshape(S, Q, H, D)


def attend_exact(q_QHD: torch.Tensor, k_LHD: torch.Tensor, v_LHD: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """Causal attention of one sequence's queries at positions `q_pos` over its keys 0..pos.

    Each query's output is bitwise what `attend_exact_batched` gives it in any batch (one
    sequence, Q queries): the generator's exact path for one sequence.
    """
    pos_1Q = torch.tensor(q_pos, dtype=torch.long, device=q_QHD.device).unsqueeze(0)
    return attend_exact_batched(q_QHD.unsqueeze(0), k_LHD.unsqueeze(0), v_LHD.unsqueeze(0), pos_1Q)[0]


class _ExactCausalAttentionFn(torch.autograd.Function):
    """Forward: `attend_exact_batched` over full sequences. Backward: the gradient of ordinary
    causal attention (the same function; only forward values need to be bitwise invariant)."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BTHD, v_BTHD):
        ctx.save_for_backward(q_BTHD, k_BTHD, v_BTHD)
        B, T = q_BTHD.shape[:2]
        pos_BT = torch.arange(T, device=q_BTHD.device).expand(B, T)
        return attend_exact_batched(q_BTHD, k_BTHD, v_BTHD, pos_BT)

    @staticmethod
    def backward(ctx, grad_BTHD):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
            return torch.autograd.grad(out, (q, k, v), grad_BTHD)


def attend_exact_spans(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor, spans: list[list[tuple[int, int]]]
) -> torch.Tensor:
    """Exact causal attention within each document of packed rows: row r holds documents
    `spans[r] = [(start, end), ...]` covering all its T positions in order, positions restarting
    at 0 in each. Every token gets the bits it gets in its own padded row (`ExactCausalAttention`):
    the documents are gathered into rows of their own and attended in one batched call."""
    B, T = q_BTHD.shape[:2]
    docs = [(r * T + a, b - a) for r, row in enumerate(spans) for a, b in row]
    assert sum(n for _, n in docs) == B * T, "spans must cover every position of every row"
    L = max(n for _, n in docs)
    offsets_L = torch.arange(L, device=q_BTHD.device)
    start_D1 = torch.tensor([s for s, _ in docs], device=q_BTHD.device)[:, None]
    len_D1 = torch.tensor([n for _, n in docs], device=q_BTHD.device)[:, None]
    # Past its end a document's row repeats its last token: finite, never seen by its queries.
    index_DL = start_D1 + torch.minimum(offsets_L[None, :], len_D1 - 1)
    q, k, v = (t.reshape(B * T, *t.shape[2:])[index_DL] for t in (q_BTHD, k_BTHD, v_BTHD))
    out_DLHD = _ExactCausalAttentionFn.apply(q, k, v)
    # Documents in row order, positions in order: the valid entries are the packed layout.
    return out_DLHD[offsets_L[None, :] < len_D1].view(q_BTHD.shape)


class ExactCausalAttention:
    """`AttentionBackend` for full sequences (the trainer's side of batch-invariant mode)."""

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        return _ExactCausalAttentionFn.apply(q_BTHD, k_BTHD, v_BTHD)

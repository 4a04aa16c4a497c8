"""Batch-invariant execution: a token's numbers do not depend on which other tokens share its batch.

BLAS picks different kernels (and summation orders) for different numbers of rows, so the same
token gets slightly different logits when the generator decodes it among 3 sequences and when the
trainer scores it among 40 positions. Under `batch_invariant_mode()` matmuls are replaced by an
elementwise product and a reduction over the contiguous inner dimension, whose order depends
only on that dimension's length, and attention uses `attend_exact`, which reduces over exactly
the keys a query may see. With both sides in this mode, generator and trainer logprobs are
bitwise identical. It is slow: a correctness mode for tests and debugging, not for speed.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Rows per chunk of the broadcast product; bounds its memory to ~rows * N * K elements.
_ROWS_PER_CHUNK = 16


def _mm_invariant(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    b_NK = b_KN.t().contiguous()
    chunks = [(a.unsqueeze(1) * b_NK.unsqueeze(0)).sum(-1) for a in a_MK.split(_ROWS_PER_CHUNK)]
    return torch.cat(chunks) if chunks else a_MK.new_empty(0, b_KN.shape[1])


class _BatchInvariantMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default:
            return _mm_invariant(*args)
        if func is aten.addmm.default and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
            bias, a, b = args
            return _mm_invariant(a, b) + bias
        if func is aten.bmm.default:
            a, b = args
            return torch.stack([_mm_invariant(x, y) for x, y in zip(a, b)])
        return func(*args, **kwargs)


def batch_invariant_mode() -> TorchDispatchMode:
    """Context manager: `with batch_invariant_mode(): model(...)`."""
    return _BatchInvariantMode()


def attend_exact(q_QHD: torch.Tensor, k_LHD: torch.Tensor, v_LHD: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """Causal attention of queries at positions `q_pos` over keys 0..pos, one query at a time.

    Each query reduces over exactly pos + 1 keys in a fixed order, whatever else is in the batch.
    """
    n_rep = q_QHD.shape[1] // k_LHD.shape[1]
    k_HLD = k_LHD.repeat_interleave(n_rep, dim=1).transpose(0, 1).contiguous()
    v_HLD = v_LHD.repeat_interleave(n_rep, dim=1).transpose(0, 1).contiguous()
    scale = q_QHD.shape[-1] ** -0.5
    outs = []
    for q_HD, pos in zip(q_QHD, q_pos):
        scores_HL = (q_HD.unsqueeze(1) * k_HLD[:, : pos + 1]).sum(-1) * scale
        probs_HL = scores_HL.float().softmax(-1).to(v_HLD.dtype)
        outs.append((probs_HL.unsqueeze(-1) * v_HLD[:, : pos + 1]).sum(1))
    return torch.stack(outs)


class ExactCausalAttention:
    """`AttentionBackend` for full sequences (the trainer's side of batch-invariant mode)."""

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        T = q_BTHD.shape[1]
        return torch.stack([attend_exact(q, k, v, list(range(T))) for q, k, v in zip(q_BTHD, k_BTHD, v_BTHD)])

"""Per-document causal attention over packed rows: backends (`AttentionBackend`,
`models/model.py`) with which a token of a packed row attends only to the earlier tokens of its own
document.

`DocumentSDPA` (a block-diagonal causal boolean mask for SDPA; the CPU default),
`DocumentFlexAttention` (FlexAttention with a document block mask from `create_block_mask`: blocks
of other documents are skipped, not masked; the CUDA default) and `PackedExactAttention`
(batch-invariant mode: `attend_exact_spans` per document, so packed logprobs are bitwise those of
the padded rows). `data/batch_forward.py: packed_backend` picks one for a batch's layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanrl.models.batch_invariant import attend_exact_spans


class DocumentSDPA:
    """Causal attention within each document of a packed row: SDPA with a [R, 1, S, S] mask."""

    def __init__(self, doc_RS: torch.Tensor) -> None:
        S = doc_RS.shape[1]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=doc_RS.device).tril()
        self.mask_R1SS = ((doc_RS[:, :, None] == doc_RS[:, None, :]) & causal_SS)[:, None]

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_BTHD.transpose(1, 2),
            k_BTHD.transpose(1, 2),
            v_BTHD.transpose(1, 2),
            attn_mask=self.mask_R1SS,
            enable_gqa=q_BTHD.shape[2] != k_BTHD.shape[2],
        ).transpose(1, 2)


_compiled_flex = None


def _flex(*args, **kwargs):
    """flex_attention, compiled once (eager flex materialises the scores: a CPU correctness path)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling() or args[0].device.type == "cpu":
        return flex_attention(*args, **kwargs)
    if _compiled_flex is None:  # packed widths vary per batch: dynamic shapes after the first recompile
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(*args, **kwargs)


class DocumentFlexAttention:
    """Causal attention within each document of a packed row: FlexAttention with a block mask
    (built once per batch, shared by every layer)."""

    def __init__(self, doc_RS: torch.Tensor) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        def document_causal(b, h, q_idx, kv_idx):
            return (doc_RS[b, q_idx] == doc_RS[b, kv_idx]) & (q_idx >= kv_idx)

        R, S = doc_RS.shape
        self.block_mask = create_block_mask(document_causal, R, None, S, S, device=doc_RS.device)

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        out_BHTD = _flex(
            q_BTHD.transpose(1, 2),
            k_BTHD.transpose(1, 2),
            v_BTHD.transpose(1, 2),
            block_mask=self.block_mask,
            enable_gqa=q_BTHD.shape[2] != k_BTHD.shape[2],
        )
        return out_BHTD.transpose(1, 2)


class PackedExactAttention:
    """Batch-invariant attention over packed rows (`attend_exact_spans`): each document's tokens
    reduce over exactly the keys they see in their own padded row."""

    def __init__(self, spans: list[list[tuple[int, int]]]) -> None:
        self.spans = spans

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        return attend_exact_spans(q_BTHD, k_BTHD, v_BTHD, self.spans)

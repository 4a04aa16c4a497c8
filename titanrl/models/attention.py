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
from titanrl.models.gpt_oss import renormalize_with_sinks, sink_softmax_attention


class DocumentSDPA:
    """Causal attention within each document of a packed row: SDPA with a [R, 1, S, S] mask
    (gpt-oss: the explicit softmax with sinks, the mask cut to the window)."""

    supports_sinks = True

    def __init__(self, doc_RS: torch.Tensor) -> None:
        S = doc_RS.shape[1]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=doc_RS.device).tril()
        self.mask_R1SS = ((doc_RS[:, :, None] == doc_RS[:, None, :]) & causal_SS)[:, None]

    def attend(
        self,
        layer_id: int,
        q_BTHD: torch.Tensor,
        k_BTHD: torch.Tensor,
        v_BTHD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        if sinks_H is not None:
            visible_RSS = self.mask_R1SS[:, 0]
            if window > 0:  # documents are contiguous: the window is a distance along the row
                i_S = torch.arange(visible_RSS.shape[-1], device=visible_RSS.device)
                visible_RSS = visible_RSS & (i_S[:, None] - i_S[None, :] < window)
            return sink_softmax_attention(q_BTHD, k_BTHD, v_BTHD, visible_RSS, sinks_H)
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
    (built once per batch, shared by every layer; gpt-oss: one per window, and the output
    renormalised with the sinks by its log-sum-exp)."""

    supports_sinks = True

    def __init__(self, doc_RS: torch.Tensor) -> None:
        self.doc_RS = doc_RS
        self.block_mask = self._block_mask(0)
        self.window_masks: dict[int, object] = {}

    def _block_mask(self, window: int):
        from torch.nn.attention.flex_attention import create_block_mask

        doc_RS = self.doc_RS

        def document_causal(b, h, q_idx, kv_idx):
            causal = (doc_RS[b, q_idx] == doc_RS[b, kv_idx]) & (q_idx >= kv_idx)
            return causal & (q_idx - kv_idx < window) if window > 0 else causal

        R, S = doc_RS.shape
        return create_block_mask(document_causal, R, None, S, S, device=doc_RS.device)

    def attend(
        self,
        layer_id: int,
        q_BTHD: torch.Tensor,
        k_BTHD: torch.Tensor,
        v_BTHD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        if window > 0 and window not in self.window_masks:
            self.window_masks[window] = self._block_mask(window)
        args = (q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHD.transpose(1, 2))
        kwargs = dict(
            block_mask=self.window_masks[window] if window > 0 else self.block_mask,
            enable_gqa=q_BTHD.shape[2] != k_BTHD.shape[2],
        )
        if sinks_H is None:
            return _flex(*args, **kwargs).transpose(1, 2)
        from torch.nn.attention.flex_attention import AuxRequest

        out_BHTD, aux = _flex(*args, **kwargs, return_aux=AuxRequest(lse=True))
        return renormalize_with_sinks(out_BHTD.transpose(1, 2), aux.lse.transpose(1, 2), sinks_H)


class PackedExactAttention:
    """Batch-invariant attention over packed rows (`attend_exact_spans`): each document's tokens
    reduce over exactly the keys they see in their own padded row."""

    def __init__(self, spans: list[list[tuple[int, int]]]) -> None:
        self.spans = spans

    def attend(self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
        return attend_exact_spans(q_BTHD, k_BTHD, v_BTHD, self.spans)

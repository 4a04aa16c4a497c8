"""gpt-oss (transformers' `GptOssForCausalLM`): the parts that differ from Qwen3-MoE.

- Attention sinks: each head has a learned logit that joins every softmax denominator and
  takes no value (`eager_attention_forward` of transformers), so a head may attend to nothing.
  Sliding-window layers (`args.layer_window`) let a query see its `sliding_window` most recent
  keys, itself included (HF's `kv_idx > q_idx - sliding_window`). The model's own attention
  (`sink_attention` without a backend) computes the softmax explicitly; a backend that takes
  sinks (the generator's paged backends) gets them as `attend(..., sinks_H=, window=)`.
- YaRN RoPE (`models/yarn.py`): transformers' `_compute_yarn_parameters`, its attention factor
  scaling cos and sin.
- The MoE (`GptOssMoE`): a router with a bias whose k weights are the softmax over the chosen
  experts' logits (`GptOssTopKRouter`), experts with biases and the clamped SwiGLU
  (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up on both sides at `limit`.
  The experts keep titanrl's grouped layout (w1 gate, w3 up, w2 down, [E, ...]) plus b1 / b3 /
  b2; `hf_gpt_oss.py` maps HF's interleaved `gate_up_proj` onto them.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanrl.models.args import TransformerModelArgs
from titanrl.models.moe import GroupedExperts, MoE, SharedExperts, grouped_mm_supported


def visible_keys(pos_SQ: torch.Tensor, key_pos_L: torch.Tensor, window: int) -> torch.Tensor:
    """[S, Q, L] bool: key positions a query at `pos_SQ` sees (causal; the last `window` only)."""
    visible_SQL = key_pos_L[None, None, :] <= pos_SQ[:, :, None]
    if window > 0:
        visible_SQL = visible_SQL & (key_pos_L[None, None, :] > pos_SQ[:, :, None] - window)
    return visible_SQL


def sink_softmax_attention(
    q_SQHD: torch.Tensor, k_SLHD: torch.Tensor, v_SLHD: torch.Tensor, visible_SQL: torch.Tensor, sinks_H: torch.Tensor
) -> torch.Tensor:
    """Attention of queries [S, Q, H, D] over keys / values [S, L, Hkv, D] where `visible_SQL`,
    each head's softmax with its sink logit in the denominator. Scores in float32 (or wider)."""
    H, Hkv = q_SQHD.shape[2], k_SLHD.shape[2]
    k_SLHD, v_SLHD = (t.repeat_interleave(H // Hkv, dim=2) for t in (k_SLHD, v_SLHD))
    acc = torch.promote_types(q_SQHD.dtype, torch.float32)
    scores_SHQL = torch.einsum("sqhd,slhd->shql", q_SQHD.to(acc), k_SLHD.to(acc)) * q_SQHD.shape[-1] ** -0.5
    scores_SHQL = scores_SHQL.masked_fill(~visible_SQL[:, None], float("-inf"))
    sink_SHQ1 = sinks_H.to(acc).view(1, H, 1, 1).expand(*scores_SHQL.shape[:3], 1)
    probs_SHQL = torch.softmax(torch.cat([scores_SHQL, sink_SHQ1], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("shql,slhd->sqhd", probs_SHQL, v_SLHD.to(acc)).to(q_SQHD.dtype)


def renormalize_with_sinks(out_SQHD: torch.Tensor, lse_SQH: torch.Tensor, sinks_H: torch.Tensor) -> torch.Tensor:
    """An attention output without sinks, and its log-sum-exp, -> the output with each head's
    sink in the denominator: out * exp(lse) / (exp(lse) + exp(sink))."""
    scale_SQH = torch.sigmoid(lse_SQH.float() - sinks_H.float())
    return (out_SQHD.float() * scale_SQH.unsqueeze(-1)).to(out_SQHD.dtype)


class SinkAttentionBackend(Protocol):
    """A backend (`models.model.AttentionBackend`) that also takes sinks and a window."""

    def attend(
        self,
        layer_id: int,
        q_BTHD: torch.Tensor,
        k_BTHD: torch.Tensor,
        v_BTHD: torch.Tensor,
        sinks_H: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor: ...


def sink_attention(
    layer_id: int,
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHD: torch.Tensor,
    sinks_H: torch.Tensor,
    window: int,
    backend: object | None,
) -> torch.Tensor:
    """Causal attention with sinks (and a window when `window` > 0) of a gpt-oss block."""
    if isinstance(sinks_H, DTensor):  # tensor parallel: this rank's heads
        sinks_H = sinks_H.to_local()
    if backend is None:
        T = q_BTHD.shape[1]
        pos_T = torch.arange(T, device=q_BTHD.device)
        visible_1TT = visible_keys(pos_T[None, :], pos_T, window)
        return sink_softmax_attention(q_BTHD, k_BTHD, v_BTHD, visible_1TT, sinks_H)
    if not getattr(backend, "supports_sinks", False):
        raise ValueError(
            f"gpt-oss attention needs sinks and sliding windows, which {type(backend).__name__} does not "
            "implement: use unpacked rows (no [training] packing) or the generator's paged backends"
        )
    sink_backend: SinkAttentionBackend = backend  # type: ignore[assignment]  # checked above
    return sink_backend.attend(layer_id, q_BTHD, k_BTHD, v_BTHD, sinks_H=sinks_H, window=window)


class GptOssTopKRouter(nn.Module):
    """Top-k of the biased router logits; the k weights are the softmax over those k logits."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=True)

    def forward(
        self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None, routes_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k], probabilities over all experts [T, E] in
        float32 or wider: the aux loss's); `expert_bias_E` and `routes_TK` as `TopKRouter`'s."""
        logits_TE = self.gate(x_TD)
        scores_TE = logits_TE if expert_bias_E is None else logits_TE + expert_bias_E
        chosen_TK = torch.topk(scores_TE, self.top_k, dim=-1).indices
        routes_TK = chosen_TK if routes_TK is None else torch.where(routes_TK < 0, chosen_TK, routes_TK)
        weights_TK = torch.softmax(logits_TE.gather(1, routes_TK), dim=-1)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.promote_types(x_TD.dtype, torch.float32))
        return weights_TK.to(x_TD.dtype), routes_TK, probs_TE

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.gate.bias)


class GptOssExperts(GroupedExperts):
    """E experts w2[e] act(w1[e] x + b1[e], w3[e] x + b3[e]) + b2[e], act the clamped SwiGLU."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float):
        super().__init__(num_experts, dim, hidden_dim)
        self.alpha, self.limit = alpha, limit
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def local_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """b1, b2, b3 of the experts this rank holds."""
        b1, b2, b3 = (b.to_local() if isinstance(b, DTensor) else b for b in (self.b1, self.b2, self.b3))
        return b1, b2, b3

    def forward(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if grouped_mm_supported(x_SD):
            return self.forward_grouped(x_SD, counts_E)
        return self.forward_loop(x_SD, counts_E)

    def forward_grouped(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        (w1, w2, w3), (b1, b2, b3) = self.local_weights(), self.local_biases()
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        expert_S = torch.repeat_interleave(
            torch.arange(counts_E.numel(), device=x_SD.device), counts_E, output_size=x_SD.shape[0]
        )
        gate_SH = torch._grouped_mm(x_SD, w1.transpose(-2, -1), offs=offsets_E) + b1[expert_S]
        up_SH = torch._grouped_mm(x_SD, w3.transpose(-2, -1), offs=offsets_E) + b3[expert_S]
        return torch._grouped_mm(self.act(gate_SH, up_SH), w2.transpose(-2, -1), offs=offsets_E) + b2[expert_S]

    def forward_loop(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        (w1, w2, w3), (b1, b2, b3) = self.local_weights(), self.local_biases()
        outs = []
        for e, x_ND in enumerate(torch.split(x_SD, counts_E.tolist())):
            if x_ND.shape[0] == 0:
                continue
            h_NH = self.act(F.linear(x_ND, w1[e], b1[e]), F.linear(x_ND, w3[e], b3[e]))
            outs.append(F.linear(h_NH, w2[e], b2[e]))
        return torch.cat(outs) if outs else x_SD.new_zeros(x_SD.shape)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for b in (self.b1, self.b2, self.b3):
            nn.init.zeros_(b)


class GptOssMoE(MoE):
    """`MoE` with gpt-oss's router and experts (routing replay, aux loss, EP as for Qwen3-MoE)."""

    def __init__(self, args: TransformerModelArgs, shared_experts: SharedExperts | None = None):
        super().__init__(args, shared_experts)
        self.router = GptOssTopKRouter(args.dim, args.moe_num_experts, args.moe_top_k)  # type: ignore[assignment]
        self.experts = GptOssExperts(
            args.moe_num_experts, args.dim, args.moe_hidden_dim, args.swiglu_alpha, args.swiglu_limit
        )

"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight), as transformers'
`DeepseekV3Attention` computes it.

Queries: `wq` (no `q_lora_rank`) or `wq_b(q_norm(wq_a(x)))`, per head a part without RoPE
(`qk_nope_head_dim`) and one with RoPE (`qk_rope_head_dim`). Keys and values come from one
compressed latent per token: `wkv_a(x)` = [c (kv_lora_rank), k_pe (qk_rope_head_dim)], c is
normed (`kv_norm`) and up-projected by `wkv_b` to each head's k_nope and v; k_pe, rotated, is
shared by all heads. Softmax scale: qk_head_dim ** -0.5, times YaRN's mscale(factor,
mscale_all_dim) ** 2 where YaRN is configured.

Training attends with per-head K/V. A backend that keeps a KV cache (`caches_kv`, the
generator's paged attention) gets the latent instead, weight-absorbed: with W_UK, W_UV the
per-head blocks of `wkv_b`, q_nope . (W_UK c) = (W_UK^T q_nope) . c and the output
W_UV (sum_j p_j c_j), so attention runs as multi-query attention whose one key per token is
[c, k_pe] (kv_lora_rank + qk_rope_head_dim values) and whose value is c, its first part: the
cache holds that latent and nothing per head. The backend reads the whole latent as the value
too (one tensor, and K and V of one width for every attention kernel); the output's rope
columns are dropped.
"""

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from titanrl.models.args import TransformerModelArgs
from titanrl.models.model import AttentionBackend, RMSNorm, apply_rope
from titanrl.models.yarn import yarn_mscale

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with the default eps, not rms_norm_eps."""


def mla_softmax_scale(args: TransformerModelArgs) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    yarn = args.rope_yarn
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def apply_rope_interleaved(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, rope_BTD2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE over interleaved pairs (x0, x1), (x2, x3) ...; outputs the rotated evens, then the
    rotated odds (transformers' `apply_rotary_pos_emb_interleave`: q and k share the layout)."""
    cos, sin = rope_BTD2.unsqueeze(2).to(q_BTHD.dtype).chunk(2, dim=-1)
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q_BTHD), rotate(k_BTHD)


def _copy_to_tp_region(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over `like`'s (a TP-sharded weight's)
    mesh (Megatron's f): a replicated tensor that each rank uses for its own heads only."""
    if not isinstance(like, DTensor) or not torch.is_grad_enabled():
        return x
    replicated = DTensor.from_local(x, like.device_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (TP-sharded) weight."""
    return w.to_local() if isinstance(w, DTensor) else w


def _applied_weight(linear: nn.Linear) -> torch.Tensor:
    """This rank's shard of the weight `linear` applies: with a LoRA adapter on
    (`models/lora.py`, the generator's 'runtime' mode) W + (alpha / r) B A, as its forward adds."""
    w = _local(linear.weight)
    lora_a, lora_b = getattr(linear, "lora_a", None), getattr(linear, "lora_b", None)
    if isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear) and getattr(linear, "adapters_enabled", False):
        return torch.addmm(w, _local(lora_b.weight), _local(lora_a.weight), alpha=cast(float, linear.scaling))
    return w


class MLAttention(nn.Module):
    """Multi-head latent attention (module docstring); `forward` as `Attention.forward`."""

    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = args.o_bias  # HF attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=bias)
        self.softmax_scale = mla_softmax_scale(args)
        self.rope = apply_rope_interleaved if args.rope_interleave else apply_rope

    def queries(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """q [B, T, heads, qk_nope_head_dim + qk_rope_head_dim] (local heads under TP)."""
        if self.wq is not None:
            q = self.wq(x_BTD)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x_BTD)))
        return q.view(*x_BTD.shape[:2], -1, self.nope_dim + self.rope_dim)

    def forward(
        self, x_BTD: torch.Tensor, rope_BTD2: torch.Tensor, backend: AttentionBackend | None = None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_nope, q_pe = self.queries(x_BTD).split([self.nope_dim, self.rope_dim], dim=-1)
        c_BTR, k_pe = self.wkv_a(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_BTR = self.kv_norm(c_BTR)
        k_pe = _copy_to_tp_region(k_pe, self.wkv_b.weight)  # under TP every rank's heads use k_pe
        q_pe, k_pe_BT1D = self.rope(q_pe, k_pe.unsqueeze(2), rope_BTD2)
        if backend is not None and getattr(backend, "caches_kv", False):
            return self.wo(self.attend_latent(backend, q_nope, q_pe, c_BTR, k_pe_BT1D).reshape(B, T, -1))
        k_nope, v = self.wkv_b(c_BTR).view(B, T, -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe_BT1D.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if backend is None:
            out_BHTD = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.softmax_scale
            )
            return self.wo(out_BHTD.transpose(1, 2).reshape(B, T, -1))
        # Backends scale by q's dim ** -0.5: q carries the rest (1 without YaRN's mscale).
        ratio = self.softmax_scale * q.shape[-1] ** 0.5
        out_BTHD = backend.attend(self.layer_id, q if ratio == 1.0 else q * ratio, k, v)
        return self.wo(out_BTHD.reshape(B, T, -1))

    def attend_latent(
        self,
        backend: AttentionBackend,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_BTR: torch.Tensor,
        k_pe_BT1D: torch.Tensor,
    ) -> torch.Tensor:
        """Weight-absorbed attention over the latent (module docstring): [B, T, heads, v_head_dim]."""
        w_HXR = _applied_weight(self.wkv_b).view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk_HNR, w_uv_HVR = w_HXR.split([self.nope_dim, self.v_dim], dim=1)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk_HNR)
        q_abs = torch.cat([q_lat, q_pe], dim=-1)
        q_abs = q_abs * (self.softmax_scale * q_abs.shape[-1] ** 0.5)
        latent_BT1L = torch.cat([c_BTR.unsqueeze(2), k_pe_BT1D], dim=-1)
        out_BTHL = backend.attend(self.layer_id, q_abs, latent_BT1L, latent_BT1L)
        out_BTHR = out_BTHL[..., : self.kv_lora_rank]
        return torch.einsum("bthr,hvr->bthv", out_BTHR, w_uv_HVR)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq_a, self.wkv_a, self.wo):
            if linear is not None and linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()


def latent_cache_dims(args: TransformerModelArgs) -> tuple[int, int]:
    """(KV heads, head dim) of MLA's paged cache: one latent [c, k_pe] per token and layer,
    read as both K and V."""
    return 1, args.kv_lora_rank + args.qk_rope_head_dim

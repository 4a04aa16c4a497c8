"""Decoder-only transformer for the Llama-3, Qwen2, Qwen3 and Qwen3-MoE families.

One model code path serves the trainer and (later) the generator, so both compute the same
numbers. Parameter names follow TorchTitan (`attention.wq`, `feed_forward.w1`, ...); the HF
adapter maps them. RoPE uses the "rotate half" layout that HF checkpoints are stored in, so q/k
weights load without permutation.
"""

import math
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanrl.models.args import RopeScaling, TransformerModelArgs
from titanrl.models.gated_deltanet import GatedDeltaNet, LinearStates
from titanrl.models.gpt_oss import GptOssMoE, sink_attention
from titanrl.models.logprobs import chunked_token_logprobs, vocab_parallel_token_logprobs
from titanrl.models.moe import MoE
from titanrl.models.yarn import yarn_inv_freq


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama-3.1: leave high frequencies alone, divide low ones by `factor`, interpolate between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def precompute_rope_cache(args: TransformerModelArgs) -> torch.Tensor:
    """[max_seq_len, 2 * rotary_dim] table of cos | sin in float32 (rotary_dim: head_dim unless
    partial rotary)."""
    inv_freq = rope_inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling)
    scale = 1.0
    if args.rope_yarn is not None:  # gpt-oss, DeepSeek-V3
        inv_freq, scale = yarn_inv_freq(args.rotary_dim, args.rope_theta, args.rope_yarn)
    t = torch.arange(args.max_seq_len, dtype=torch.float32)
    freqs_TD = torch.outer(t, inv_freq)
    emb_TD = torch.cat([freqs_TD, freqs_TD], dim=-1)
    if scale != 1.0:
        return torch.cat([emb_TD.cos() * scale, emb_TD.sin() * scale], dim=-1)
    return torch.cat([emb_TD.cos(), emb_TD.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(
    q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, rope_BTD2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_BTD2.unsqueeze(2).to(q_BTHD.dtype).chunk(2, dim=-1)
    if cos.shape[-1] < q_BTHD.shape[-1]:  # partial rotary (Qwen3.5): the first dims only
        r = cos.shape[-1]
        q_rot, k_rot = apply_rope(q_BTHD[..., :r], k_BTHD[..., :r], rope_BTD2)
        return torch.cat([q_rot, q_BTHD[..., r:]], -1), torch.cat([k_rot, k_BTHD[..., r:]], -1)
    q = q_BTHD * cos + _rotate_half(q_BTHD) * sin
    k = k_BTHD * cos + _rotate_half(k_BTHD) * sin
    return q, k


def _of_last_forward(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None, "an MoE layer's routes and aux loss exist after a forward"
    return value


class AttentionBackend(Protocol):
    """Replaces the causal self-attention core; the generator passes one over its paged KV cache.

    `attend` gets this layer's rotated q [B, T, H, D] and k, v [B, T, Hkv, D] (local heads under
    TP) and returns the attention output [B, T, H, D].
    """

    def attend(
        self, layer_id: int, q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as HF Llama/Qwen do.
        x_f32 = x.float()
        x_f32 = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_f32.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        # With an output gate, q's projection gives [q, gate] per head (HF Qwen3.5's layout).
        self.output_gate = args.attn_output_gate
        q_size = args.n_heads * args.head_dim * (2 if self.output_gate else 1)
        self.wq = nn.Linear(args.dim, q_size, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        # gpt-oss: a learned sink logit per head, and the layer's sliding window (0: none).
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.family == "gpt_oss" else None
        self.window = args.layer_window(layer_id)

    def forward(
        self, x_BTD: torch.Tensor, rope_BTD2: torch.Tensor, backend: AttentionBackend | None = None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x_BTD).view(B, T, -1, self.head_dim * (2 if self.output_gate else 1))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        v = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None, "qk_norm makes both norms"
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rope(q, k, rope_BTD2)
        if self.sinks is not None:
            out_BTHD = sink_attention(self.layer_id, q, k, v, self.sinks, self.window, backend)
        elif backend is not None:
            out_BTHD = backend.attend(self.layer_id, q, k, v)
        else:
            out_BTHD = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            ).transpose(1, 2)
        if self.output_gate:
            out_BTHD = out_BTHD * torch.sigmoid(gate)
        return self.wo(out_BTHD.reshape(B, T, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


def _mla(layer_id: int, args: TransformerModelArgs) -> Attention:
    """DeepSeek-V3's multi-head latent attention (`mla.py`, which builds on this module): typed
    as the `Attention` whose `forward` and `init_weights` it has."""
    from titanrl.models.mla import MLAttention

    return cast(Attention, MLAttention(layer_id, args))


class TransformerBlock(nn.Module):
    """Attention, then a dense SwiGLU (`feed_forward`) or a mixture of experts (`moe`) as
    `args.is_moe_layer(layer_id)` says; the other attribute is None."""

    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        # Qwen3.5's hybrid: a gated DeltaNet layer replaces attention in some blocks; DeepSeek-V3:
        # multi-head latent attention (`mla.py`).
        self.linear_attn = GatedDeltaNet(layer_id, args) if args.is_linear_layer(layer_id) else None
        self.attention = None
        if self.linear_attn is None:
            self.attention = Attention(layer_id, args) if not args.kv_lora_rank else _mla(layer_id, args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        self.moe: MoE | None
        self.feed_forward: FeedForward | None
        if self.moe_enabled:
            shared = args.moe_hidden_dim * args.moe_shared_experts
            moe_cls = GptOssMoE if args.family == "gpt_oss" else MoE
            self.moe = moe_cls(args, FeedForward(args.dim, shared) if shared else None)
            self.feed_forward = None
        else:
            self.moe = None
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope_BTD2: torch.Tensor,
        backend: AttentionBackend | None = None,
        routes_TK: torch.Tensor | None = None,
        starts_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`routes_TK`: the experts of an MoE block's B * T tokens (routing replay); `starts_BT`:
        where the documents of packed rows start (a linear-attention block resets its state)."""
        h = x_BTD + self._mix(self.attention_norm(x_BTD), rope_BTD2, backend, starts_BT)
        if self.moe is not None:
            return h + self.moe(self.ffn_norm(h), routes_TK)
        assert self.feed_forward is not None, "a block without moe has a feed_forward"
        return h + self.feed_forward(self.ffn_norm(h))

    def _mix(
        self,
        x_BTD: torch.Tensor,
        rope_BTD2: torch.Tensor,
        backend: AttentionBackend | None,
        starts_BT: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.linear_attn is not None:
            # The generator's backend carries the sequences' state slots (`LinearStates`).
            states = cast(LinearStates | None, getattr(backend, "linear_states", None))
            return self.linear_attn(x_BTD, starts_BT, states)
        assert self.attention is not None, "a block has attention or a linear layer"
        return self.attention(x_BTD, rope_BTD2, backend)

    def init_weights(self, buffer_device: torch.device) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        if self.linear_attn is not None:
            self.linear_attn.init_weights(self.weight_init_std)
        else:
            assert self.attention is not None, "a block has attention or a linear layer"
            self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            assert self.feed_forward is not None, "a block without moe has a feed_forward"
            self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    """Build on the meta device, parallelize, `to_empty(device=...)`, then `init_weights()`."""

    rope_cache: torch.Tensor
    """[max_seq_len, 2 * head_dim] cos | sin (a non-persistent buffer)."""
    cp_mesh: DeviceMesh | None = None
    """The context-parallel group (`titanrl.distributed.parallelize`); None without context parallelism."""

    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps layer names stable when blocks are wrapped (AC) or compiled.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.num_labels or args.vocab_size, bias=False)
        if args.ties_output:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", precompute_rope_cache(args), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill parameters and buffers; call after `to_empty` (which also unties shared weights)."""
        if self.args.ties_output and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        buffer_device = buffer_device or self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = precompute_rope_cache(self.args)
        # A tied matrix is also the output projection, so it gets the small std of a linear layer.
        nn.init.normal_(self.tok_embeddings.weight, std=0.02 if self.args.ties_output else 1.0)
        for block in self.blocks():
            block.init_weights(buffer_device)
        self.norm.reset_parameters()
        if not self.args.ties_output:
            final_std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std, b=3 * final_std)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
        routes_LTK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (scores [B, T, num_labels] for a score head). `positions_BT` defaults
        to 0..T-1 for every row; `backend` replaces causal attention over the batch (the generator's
        paged KV cache); `routes_LTK` as in `hidden_states`."""
        return self.output(self.hidden_states(tokens_BT, positions_BT, backend, routes_LTK))

    def blocks(self) -> list[TransformerBlock]:
        """The blocks in layer order. One wrapped by activation checkpointing or compile forwards
        the block's attributes: it is used as the block."""
        return [cast(TransformerBlock, block) for block in self.layers.values()]

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards in layer order (empty for a dense model)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_routes(self) -> torch.Tensor:
        """The experts the last forward used, [MoE layers, B * T, top_k]: what `routes_LTK` takes."""
        return torch.stack([_of_last_forward(m.routes_TK) for m in self.moe_layers()])

    def moe_aux_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss, the mean over MoE layers of each layer's
        `moe.load_balancing_loss` (differentiable; the trainer scales it by its coefficient)."""
        return torch.stack([_of_last_forward(m.aux_loss) for m in self.moe_layers()]).mean()

    def logprobs(
        self,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        chunk_tokens: int,
        with_entropy: bool = False,
        backend: AttentionBackend | None = None,
        mask_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
        routes_LTK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(targets) [B, T] in float32, entropy [B, T] or None) without [B, T, vocab]
        logits: `chunk_tokens` positions of logits at a time (`models/logprobs.py`), only where
        `mask_BT` is non-zero when it is given (0 elsewhere). Under TP the head's weight is a
        vocab-sharded DTensor: each rank projects onto its vocab shard and the softmax is
        reduced over tp (vocab-parallel chunks, no gathered logits; `self.output` is not called).
        `positions_BT` and `routes_LTK` as in `hidden_states` (packed rows: positions restart at
        each document)."""
        h_BTD = self.hidden_states(tokens_BT, positions_BT, backend, routes_LTK)
        weight_VD = self.output.weight
        if isinstance(weight_VD, DTensor):
            return vocab_parallel_token_logprobs(h_BTD, weight_VD, targets_BT, chunk_tokens, with_entropy, mask_BT)
        return chunked_token_logprobs(h_BTD, weight_VD, targets_BT, chunk_tokens, with_entropy, mask_BT)

    def hidden_states(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
        routes_LTK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final normed hidden states [B, T, dim], before the output layer: a caller that
        needs logits at a few positions only (the generator's prefill) applies `output` to those.
        `routes_LTK`: the experts each MoE layer uses for the B * T tokens (routing replay; the
        layout of `moe_routes()`); None: the routers choose."""
        if positions_BT is None:
            T = tokens_BT.shape[1]
            if T > self.args.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len}")
            rope_BTD2 = self.rope_cache[:T].unsqueeze(0)
        else:
            rope_BTD2 = self.rope_cache[positions_BT]
        h = self.tok_embeddings(tokens_BT)
        # Packed rows (positions restart at 0): the linear layers reset their state there.
        starts_BT = positions_BT == 0 if positions_BT is not None and self.args.has_linear_layers else None
        if routes_LTK is None:
            for block in self.layers.values():
                h = block(h, rope_BTD2, backend, None, starts_BT)
            return self.norm(h)
        n_moe = sum(map(self.args.is_moe_layer, range(self.args.n_layers)))
        if routes_LTK.shape[0] != n_moe:
            raise ValueError(f"routes_LTK has {routes_LTK.shape[0]} layers of routes; the model has {n_moe} MoE layers")
        routes = iter(routes_LTK)
        for block in self.layers.values():
            h = block(h, rope_BTD2, backend, next(routes) if block.moe_enabled else None, starts_BT)
        return self.norm(h)

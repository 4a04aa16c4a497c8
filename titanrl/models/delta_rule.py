"""The gated delta rule (Gated DeltaNet, Qwen3.5 / Qwen3-Next linear attention) in PyTorch.

Per value head the state S [Dk, Dv] evolves token by token as

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),
    o_t = S_t^T (q_t * scale),

with g_t <= 0 the log decay and beta_t in (0, 1) the write strength. `chunk_gated_delta_rule`
computes it for training and prefill in chunks of 64 tokens (the WY / UT form: one triangular
solve per chunk, a sequential scan over chunks only); `recurrent_gated_delta_rule` is the
token-by-token form the decode step uses. Both keep the state in float32 (float64 when the
inputs are float64, which the tests use to check the algebra exactly).

Ragged batches are right-padded rows with beta = 0 and g = 0 at the padding: such a token leaves
the state unchanged, so each row's final state is its sequence's own.

The Triton kernels of flash-linear-attention are not wired in: this path is the reference, the
CPU path and what runs (compiled) on GPU.
"""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked form."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the flash-linear-attention convention HF uses)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _zero_state(B: int, H: int, K: int, V: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(B, H, K, V, dtype=like.dtype, device=like.device)


def chunk_gated_delta_rule(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, T, H, V] in v's dtype, final state [B, H, K, V] in float32 / float64).
    q and k have one head per value head (the caller repeats grouped key heads)."""
    B, T, H, K = k_BTHK.shape
    V = v_BTHV.shape[-1]
    dtype = _compute_dtype(v_BTHV)
    scale = K**-0.5 if scale is None else scale
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (q_BTHK, k_BTHK, v_BTHV))
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g_BTH, beta_BTH))
    pad = (-T) % chunk_size
    # Padding tokens: k = 0, beta = 0, g = 0 leave the state as it is.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N, C = (T + pad) // chunk_size, chunk_size
    q = q.reshape(B, H, N, C, K) * scale
    k = k.reshape(B, H, N, C, K)
    v = v.reshape(B, H, N, C, V)
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    G = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    upper_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay_CC = (G[..., :, None] - G[..., None, :]).masked_fill(upper_CC, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # The unit lower-triangular system (I + strict_tril(beta K K^T * decay)) U = beta (V - e^G K S0):
    # solve_triangular reads the strict lower triangle only (unitriangular).
    system_CC = (k_beta @ k.transpose(-1, -2)) * decay_CC
    u0 = torch.linalg.solve_triangular(system_CC, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system_CC, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    attn_CC = (q @ k.transpose(-1, -2)) * decay_CC
    q_decayed = q * G.exp()[..., None]
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    state = _zero_state(B, H, K, V, v) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    out = torch.empty_like(v)
    for n in range(N):
        u = u0[:, :, n] - w[:, :, n] @ state
        out[:, :, n] = q_decayed[:, :, n] @ state + attn_CC[:, :, n] @ u
        state = state * chunk_decay[:, :, n] + k_decayed[:, :, n].transpose(-1, -2) @ u
    out_BTHV = out.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return out_BTHV.to(v_BTHV.dtype), state


def recurrent_gated_delta_rule(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    initial_state_BHKV: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form of `chunk_gated_delta_rule` (same arguments and results); the decode
    step calls it with T = 1."""
    B, T, H, K = k_BTHK.shape
    V = v_BTHV.shape[-1]
    dtype = _compute_dtype(v_BTHV)
    scale = K**-0.5 if scale is None else scale
    q, k, v = (x.to(dtype) for x in (q_BTHK, k_BTHK, v_BTHV))
    g, beta = g_BTH.to(dtype), beta_BTH.to(dtype)
    state = _zero_state(B, H, K, V, v) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    outs = []
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        predicted_BHV = (state * k[:, t, :, :, None]).sum(-2)
        u_BHV = (v[:, t] - predicted_BHV) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * u_BHV[:, :, None, :]
        outs.append((state * (q[:, t] * scale)[..., None]).sum(-2))
    return torch.stack(outs, dim=1).to(v_BTHV.dtype), state

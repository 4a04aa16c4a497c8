"""Gated DeltaNet: the linear-attention layer of Qwen3.5's hybrid blocks (HF `Qwen3_5GatedDeltaNet`).

A layer projects the hidden states to q | k | v (one fused projection), runs a causal depthwise
convolution of width `linear_conv_kernel_dim` over them (then SiLU), L2-normalises q and k per
head, and computes the gated delta rule (`models/delta_rule.py`) with the write strength
beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a + dt_bias). Each of the
`linear_num_key_heads` q/k heads serves `linear_num_value_heads / linear_num_key_heads`
consecutive value heads. The output is RMS-normed per value head, gated by SiLU(z) and
projected back. Parameter names are HF's, so the adapter maps them one to one, but the rows of
`in_proj_qkv` (and the channels of `conv1d`) are grouped by key head: [q_h | k_h | v of h's value
heads] for each key head h, where HF has [all q | all k | all v] (`qkv_hf_order` permutes).
Tensor parallelism (`distributed/gated_deltanet_tp.py`) then shards them by plain row blocks of
whole key-head groups; under it the conv weight, `A_log` and `dt_bias` are DTensor shards the
forward reads locally.

A forward runs over segments: by default each row is one sequence; packed rows (`starts_BT`:
True where a document starts) are split into their documents, each starting from a zero state;
the generator (`LinearStates`) names each packed sequence's state slot, whose conv and recurrent
state the forward reads and then overwrites with the state after its tokens.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanrl.models.args import TransformerModelArgs
from titanrl.models.delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


@dataclass
class Segments:
    """Where each of S sequences lies in the flattened [B * T] tokens of a forward."""

    index_SL: torch.Tensor
    """Flattened token index of each sequence's l-th token (padding repeats index 0)."""
    valid_SL: torch.Tensor
    """Whether (s, l) is a real token (sequences are right-padded to the longest, L)."""
    length_S: torch.Tensor

    @classmethod
    def from_lengths(cls, starts: list[int], lengths: list[int], device: torch.device) -> "Segments":
        L = max(lengths)
        offsets_L = torch.arange(L, device=device)
        start_S = torch.tensor(starts, device=device)
        length_S = torch.tensor(lengths, device=device)
        valid_SL = offsets_L[None, :] < length_S[:, None]
        return cls(torch.where(valid_SL, start_S[:, None] + offsets_L[None, :], 0), valid_SL, length_S)

    @classmethod
    def of_documents(cls, starts_BT: torch.Tensor) -> "Segments":
        """The documents of packed rows: each row's first token and every True of `starts_BT`
        starts one (a host sync: the layout is data)."""
        B, T = starts_BT.shape
        starts_BT = starts_BT.clone()
        starts_BT[:, 0] = True
        flat = starts_BT.flatten().nonzero().flatten().tolist()
        ends = flat[1:] + [B * T]
        return cls.from_lengths(flat, [e - s for s, e in zip(flat, ends, strict=True)], starts_BT.device)


@dataclass
class LinearStates:
    """The generator's state slots for one forward: the packed tokens' sequences (`segments`),
    each sequence's slot, and per linear layer the slot pools (`generator/state_slots.py`)."""

    segments: Segments
    slot_S: torch.Tensor
    conv: dict[int, torch.Tensor]
    """layer id -> [num_slots, conv_dim, kernel - 1]: the last inputs of each slot's sequence."""
    recurrent: dict[int, torch.Tensor]
    """layer id -> [num_slots, value heads, key head dim, value head dim], float32."""


def causal_conv1d(
    x_SLC: torch.Tensor, weight_C1K: torch.Tensor, state_SCk: torch.Tensor, length_S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of right-padded sequences that continue after `state_SCk`
    (their K - 1 previous inputs): (output [S, L, C], the new state: the last K - 1 inputs)."""
    K = weight_C1K.shape[-1]
    full_SCX = torch.cat([state_SCk.to(x_SLC.dtype), x_SLC.transpose(1, 2)], dim=-1)
    out_SCL = F.conv1d(full_SCX, weight_C1K, groups=x_SLC.shape[-1])
    take_SK = length_S[:, None] + torch.arange(K - 1, device=x_SLC.device)[None, :]
    C = x_SLC.shape[-1]
    new_state = full_SCX.gather(2, take_SK[:, None, :].expand(-1, C, -1))
    return out_SCL.transpose(1, 2), new_state


def qkv_hf_order(args: TransformerModelArgs) -> torch.Tensor:
    """Index of HF's [all q | all k | all v] row of each row of titanrl's key-head-grouped
    `in_proj_qkv` (and conv1d channel): titanrl = hf[index], hf = titanrl[index.argsort()]."""
    n_k, k_dim = args.linear_num_key_heads, args.linear_key_head_dim
    v_group = args.linear_num_value_heads // n_k * args.linear_value_head_dim
    parts = []
    for h in range(n_k):
        parts += [torch.arange(h * k_dim, (h + 1) * k_dim), n_k * k_dim + torch.arange(h * k_dim, (h + 1) * k_dim)]
        parts.append(2 * n_k * k_dim + torch.arange(h * v_group, (h + 1) * v_group))
    return torch.cat(parts)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter (the parameter itself without TP)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 for low-precision tensors (as HF), float64 kept (the tests' reference runs)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class GatedRMSNorm(nn.Module):
    """RMSNorm over a head's values, then times SiLU(z) (HF `Qwen3_5RMSNormGated`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x_f32 = x.float()
        x_f32 = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_f32.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (module docstring)."""

    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_k_heads, self.n_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.k_dim, self.v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        key_size, value_size = self.n_k_heads * self.k_dim, self.n_v_heads * self.v_dim
        self.conv_dim = 2 * key_size + value_size
        self.in_proj_qkv = nn.Linear(args.dim, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_size, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.n_v_heads, bias=False)
        K = args.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, padding=K - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.n_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, args.norm_eps)
        self.out_proj = nn.Linear(value_size, args.dim, bias=False)

    def forward(
        self, x_BTD: torch.Tensor, starts_BT: torch.Tensor | None = None, states: LinearStates | None = None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if states is not None:
            segments = states.segments
        elif starts_BT is not None:
            segments = Segments.of_documents(starts_BT)
        else:
            segments = Segments.from_lengths([b * T for b in range(B)], [T] * B, x_BTD.device)
        x_ND = x_BTD.reshape(B * T, -1)
        x_SLD = x_ND[segments.index_SL]
        out_SLHV = self._mix(x_SLD, segments, states)
        out_NHV = out_SLHV.new_zeros(B * T, *out_SLHV.shape[2:])
        out_NHV[segments.index_SL[segments.valid_SL]] = out_SLHV[segments.valid_SL]
        z_NHV = self.in_proj_z(x_ND).view(B * T, -1, self.v_dim)
        return self.out_proj(self.norm(out_NHV, z_NHV).view(B, T, -1))

    def _mix(self, x_SLD: torch.Tensor, segments: Segments, states: LinearStates | None) -> torch.Tensor:
        """The gated delta rule's output [S, L, value heads, value dim] of the segments."""
        S, L, _ = x_SLD.shape
        valid_SL1 = segments.valid_SL[..., None]
        conv_weight = _local(self.conv1d.weight)  # under TP: this rank's key-head groups
        kernel = conv_weight.shape[-1]
        if states is None:
            conv_state = x_SLD.new_zeros(S, conv_weight.shape[0], kernel - 1)
            rec_state = None
        else:
            conv_state = states.conv[self.layer_id][states.slot_S]
            rec_state = states.recurrent[self.layer_id][states.slot_S]
        qkv_SLC = self.in_proj_qkv(x_SLD) * valid_SL1
        qkv_SLC, new_conv = causal_conv1d(qkv_SLC, conv_weight, conv_state, segments.length_S)
        group = self.n_v_heads // self.n_k_heads
        # Key-head groups [q_h | k_h | v of h's value heads] (module docstring); -1: local heads.
        qkv_SLHC = F.silu(qkv_SLC).view(S, L, -1, 2 * self.k_dim + group * self.v_dim)
        q, k, v = qkv_SLHC.split([self.k_dim, self.k_dim, group * self.v_dim], dim=-1)
        q, k = (l2norm(_at_least_f32(t)).repeat_interleave(group, dim=2) for t in (q, k))
        v = v.reshape(S, L, -1, self.v_dim)
        beta = self.in_proj_b(x_SLD).sigmoid() * valid_SL1
        a = _at_least_f32(self.in_proj_a(x_SLD))
        g = -_at_least_f32(_local(self.A_log)).exp() * F.softplus(a + _local(self.dt_bias)) * valid_SL1
        rule = recurrent_gated_delta_rule if L == 1 and states is not None else chunk_gated_delta_rule
        out, new_rec = rule(q, k * valid_SL1[..., None], v, g, beta, rec_state)
        if states is not None:
            states.conv[self.layer_id][states.slot_S] = new_conv.to(conv_state.dtype)
            states.recurrent[self.layer_id][states.slot_S] = new_rec.to(torch.float32)
        return out.to(x_SLD.dtype)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std)
        nn.init.kaiming_uniform_(self.conv1d.weight, a=5**0.5)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        nn.init.ones_(self.norm.weight)


def check_parallelism(args: TransformerModelArgs, tp: int, cp: int) -> None:
    """The parallelisms a hybrid model refuses, as one-line errors naming the key and why: tp
    shards the linear layers by key-head groups, so it must divide both head counts."""
    if not args.has_linear_layers:
        return
    n_k, n_v = args.linear_num_key_heads, args.linear_num_value_heads
    if n_k % tp or n_v % tp:
        raise ValueError(
            f"[parallelism] tp = {tp} must divide linear_num_key_heads ({n_k}) and linear_num_value_heads "
            f"({n_v}) of the hybrid model's gated DeltaNet layers (each rank holds whole key-head groups); "
            f"choose a tp that divides {n_k}"
        )
    if cp > 1:
        raise ValueError(
            f"[parallelism] cp = {cp} is not supported for hybrid linear-attention models (Qwen3.5) yet: their "
            "gated DeltaNet layers would need each rank's recurrent state passed to the next rank in sequence "
            "order; set cp = 1"
        )

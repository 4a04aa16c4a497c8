"""Mixture-of-experts feed-forward (Qwen3-MoE routing, TorchTitan layout).

A token-choice top-k router (softmax over experts in float32, top-k, the k weights renormalised
when `norm_topk_prob`, as transformers' `Qwen3MoeSparseMoeBlock`), routed experts held as grouped
weights `w1, w3: [E, H, D]`, `w2: [E, D, H]` (HF's per-expert `gate_proj / up_proj / down_proj`
stacked in expert order) and optional always-on shared experts.

The experts run on the (token, slot) pairs sorted by expert: one `torch._grouped_mm` per weight
where the device and dtype have it, else a loop over the experts' contiguous slices (float64,
batch-invariant mode, old GPUs). Each expert's output is scaled by its routing weight, put back
in token order and summed over the k slots.

What later work reads after a forward, per MoE layer (`MoE` attributes):
- `routes_TK`: the experts chosen for each of the T = B * S tokens (routing replay passes such a
  table back in as `routes_TK`: the same experts, weights recomputed from the router's current
  probabilities so that the router still gets gradients). A row of a table passed in may be
  `ROUTER_ROUTE` (the router chooses) or `PAD_ROUTE` (a padding token: the router chooses, and
  the token is left out of the aux loss and the loads below), so that a padded batch's
  statistics are those of its real tokens, with replay or without;
- `aux_loss`: the Switch / Qwen load-balancing loss of this forward (differentiable);
- `tokens_per_expert`: a float32 buffer that accumulates the routed (token, slot) pairs per
  expert over forwards until `update_expert_bias` (or the caller) resets it. Activation
  checkpointing recomputes forwards and counts them twice: every count doubles, so the ratios
  that the bias update and load metrics use do not change.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanrl.models.args import TransformerModelArgs
from titanrl.models.batch_invariant import in_batch_invariant_mode

PAD_ROUTE = -1
"""A `routes_TK` row of a padding token: the router's experts, left out of the statistics."""
ROUTER_ROUTE = -2
"""A `routes_TK` row of a real token the router routes (a batch without replay, with padding)."""


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs on `x`'s device and dtype: CUDA bf16 on sm90+ (the
    kernel TorchTitan uses), CPU bf16, and CPU float32 in eager mode (compile traces bf16 only);
    never in batch-invariant mode, which covers only mm / addmm / bmm."""
    if not hasattr(torch, "_grouped_mm") or in_batch_invariant_mode():
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    eager_fp32 = x.dtype == torch.float32 and not torch.compiler.is_compiling()
    return x.device.type == "cpu" and (x.dtype == torch.bfloat16 or eager_fp32)


class TopKRouter(nn.Module):
    """Token-choice top-k routing over softmax probabilities (Qwen3-MoE's gate)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # DeepSeek-V3: sigmoid scores, group-limited choice, scaled weights (`TransformerModelArgs`).
        self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(
        self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None, routes_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k], probabilities [T, E] in float32 or wider).

        `expert_bias_E` shifts the scores for the choice of experts only; `routes_TK` replaces the
        choice, except on its negative rows (`PAD_ROUTE`, `ROUTER_ROUTE`). Either way the weights
        are the router's probabilities of the chosen experts."""
        # float32 as HF for 16/32-bit models; float64 models stay float64.
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        if self.score_func == "sigmoid":
            probs_TE = torch.sigmoid(self.gate(x_TD).to(dtype))
        else:
            probs_TE = torch.softmax(self.gate(x_TD), dim=-1, dtype=dtype)
        scores_TE = probs_TE if expert_bias_E is None else probs_TE + expert_bias_E
        if self.n_group > 1:
            scores_TE = self.limit_to_groups(scores_TE)
        chosen_TK = torch.topk(scores_TE, self.top_k, dim=-1).indices  # k of E: cheap, and no host sync
        routes_TK = chosen_TK if routes_TK is None else torch.where(routes_TK < 0, chosen_TK, routes_TK)
        weights_TK = probs_TE.gather(1, routes_TK)
        if self.norm_topk_prob:
            eps = 1e-20 if self.score_func == "sigmoid" else 0.0  # transformers' DeepSeek-V3 adds it
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + eps)
        if self.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * self.routed_scaling_factor
        return weights_TK.to(x_TD.dtype), routes_TK, probs_TE

    def limit_to_groups(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited choice: the experts outside a token's `topk_group` best
        groups (a group scored by the sum of its two best scores) get -inf."""
        T, E = scores_TE.shape
        scores_TGX = scores_TE.view(T, self.n_group, E // self.n_group)
        group_scores_TG = scores_TGX.topk(2, dim=-1).values.sum(dim=-1)
        groups_TK = group_scores_TG.topk(self.topk_group, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, groups_TK, True)
        return scores_TGX.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: expert e computes w2[e](silu(w1[e] x) * w3[e] x)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """`x_SD` holds expert 0's rows, then expert 1's ... (`counts_E` rows each).

        Under expert parallelism (`titanrl.distributed.expert_parallel`) the weights are DTensors
        sharded on the expert dim, and the rows and counts arriving here are this rank's experts'
        only: the hook where tokens are dispatched and combined wraps this call."""
        if grouped_mm_supported(x_SD):
            return self.forward_grouped(x_SD, counts_E)
        return self.forward_loop(x_SD, counts_E)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w2, w3 of the experts this rank holds (all of them without expert parallelism)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return w1, w2, w3

    def forward_grouped(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.local_weights()
        assert counts_E.numel() == w1.shape[0], (counts_E.numel(), w1.shape)
        offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        # Transposed views are the column-major right operands the CUDA kernel wants.
        h_SH = F.silu(torch._grouped_mm(x_SD, w1.transpose(-2, -1), offs=offsets_E))
        h_SH = h_SH * torch._grouped_mm(x_SD, w3.transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(h_SH, w2.transpose(-2, -1), offs=offsets_E)

    def forward_loop(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.local_weights()
        assert counts_E.numel() == w1.shape[0], (counts_E.numel(), w1.shape)
        outs = []
        for e, x_ND in enumerate(torch.split(x_SD, counts_E.tolist())):
            if x_ND.shape[0] == 0:
                continue
            h_NH = F.silu(F.linear(x_ND, w1[e])) * F.linear(x_ND, w3[e])
            outs.append(F.linear(h_NH, w2[e]))
        return torch.cat(outs) if outs else x_SD.new_zeros(x_SD.shape)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


def expert_counts(routes_TK: torch.Tensor, num_experts: int, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """(token, slot) pairs routed to each expert, [E], of the `real_T` tokens only if given.
    scatter_add, not bincount: a static output shape keeps the block compilable."""
    flat_S = routes_TK.flatten()
    if real_T is None:
        ones_S = torch.ones_like(flat_S)
    else:
        ones_S = real_T.to(flat_S.dtype).repeat_interleave(routes_TK.shape[1])
    return routes_TK.new_zeros(num_experts).scatter_add_(0, flat_S, ones_S)


def load_balancing_loss(
    probs_TE: torch.Tensor, counts_E: torch.Tensor, real_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Qwen3-MoE computes it for one layer:
    E * sum_e f_e * P_e, f_e = (routed (token, slot) pairs of e) / T (sums to k),
    P_e = mean over tokens of the router probability of e. Balanced routing gives k.
    With `real_T`, T and the mean run over those tokens (padding left out; `counts_E` theirs)."""
    T, E = probs_TE.shape
    if real_T is None:
        return E * torch.sum(counts_E.to(probs_TE.dtype) / max(T, 1) * probs_TE.mean(dim=0))
    real_T1 = real_T.to(probs_TE.dtype).unsqueeze(-1)
    n = real_T1.sum().clamp_min(1)
    return E * torch.sum(counts_E.to(probs_TE.dtype) / n * (probs_TE * real_T1).sum(dim=0) / n)


class AuxLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, `aux`'s gradient is `coeff` (Megatron's aux-loss scaler):
    the loss term coeff * aux then trains the router through whichever backward runs through this
    forward, without the caller adding it to its loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, coeff: float) -> torch.Tensor:
        ctx.coeff = coeff
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux, ctx.coeff), None


class SharedExperts(Protocol):
    """What MoE needs of its shared experts (the model's dense SwiGLU, `FeedForward`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def init_weights(self, init_std: float) -> None: ...


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing a block's dense feed-forward."""

    def __init__(self, args: TransformerModelArgs, shared_experts: SharedExperts | None = None):
        super().__init__()
        self.num_experts = args.moe_num_experts
        self.top_k = args.moe_top_k
        self.use_expert_bias = args.moe_expert_bias
        self.router = TopKRouter(
            args.dim,
            args.moe_num_experts,
            args.moe_top_k,
            args.moe_norm_topk_prob,
            args.moe_score_func,
            args.moe_n_group,
            args.moe_topk_group,
            args.moe_routed_scaling_factor,
        )
        self.experts = GroupedExperts(args.moe_num_experts, args.dim, args.moe_hidden_dim)
        self.shared_experts = shared_experts
        # Checkpointed only when routing uses it; a Qwen3-MoE checkpoint has none.
        self.register_buffer("expert_bias", torch.zeros(self.num_experts), persistent=args.moe_expert_bias)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
        self.routes_TK: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        # Weight of this layer's aux_loss in backward (`AuxLossGrad`); the trainer sets it.
        self.aux_loss_coeff = 0.0

    def forward(self, x_BTD: torch.Tensor, routes_TK: torch.Tensor | None = None) -> torch.Tensor:
        """`routes_TK`: experts to use for the B * T tokens (routing replay; negative rows: see the
        module doc); None: the router's."""
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        if routes_TK is not None and routes_TK.shape != (x_TD.shape[0], self.top_k):
            raise ValueError(f"routes_TK has shape {tuple(routes_TK.shape)}, expected ({x_TD.shape[0]}, {self.top_k})")
        real_T = None if routes_TK is None else routes_TK[:, 0] != PAD_ROUTE
        bias_E = self.expert_bias if self.use_expert_bias else None
        weights_TK, routes_TK, probs_TE = self.router(x_TD, bias_E, routes_TK)
        counts_E = expert_counts(routes_TK, self.num_experts)
        self.routes_TK = routes_TK
        # The statistics count real tokens only (masked, not indexed: no host sync).
        real_counts_E = counts_E if real_T is None else expert_counts(routes_TK, self.num_experts, real_T)
        self.aux_loss = load_balancing_loss(probs_TE, real_counts_E, real_T)
        with torch.no_grad():
            self.tokens_per_expert.add_(real_counts_E.to(self.tokens_per_expert.dtype))
        out_TD = self.routed(x_TD, weights_TK, routes_TK, counts_E)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            out_TD = AuxLossGrad.apply(out_TD, self.aux_loss, self.aux_loss_coeff)
        return out_TD.view(x_BTD.shape)

    def routed(
        self, x_TD: torch.Tensor, weights_TK: torch.Tensor, routes_TK: torch.Tensor, counts_E: torch.Tensor
    ) -> torch.Tensor:
        """Sum over the k slots of weight * expert(x), experts run on slots sorted by expert."""
        T, K = routes_TK.shape
        order_S = torch.argsort(routes_TK.flatten(), stable=True)
        y_SD = self.experts(x_TD[order_S // K], counts_E)
        y_SD = y_SD * weights_TK.flatten()[order_S].unsqueeze(-1)
        y_TKD = y_SD[torch.argsort(order_S)].view(T, K, y_SD.shape[-1])  # T may be 0
        return y_TKD.sum(dim=1)

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free update from the loads counted since the last one:
        bias_e += rate * sign(mean load - load_e), then the counts restart. Under data
        parallelism, sum `tokens_per_expert` over the ranks first so that every rank agrees."""
        load_E = self.tokens_per_expert
        self.expert_bias.add_(rate * torch.sign(load_E.mean() - load_E))
        load_E.zero_()

    def init_weights(self, init_std: float, buffer_device: torch.device) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.num_experts)
            self.tokens_per_expert = torch.zeros(self.num_experts)

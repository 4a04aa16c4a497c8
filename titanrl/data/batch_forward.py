"""The trainer's forward over a step batch: logprobs and values of the next tokens, over the
padded rows, the packed rows (`data/packing.py`, attention backends in `models/attention.py`) or
this rank's context-parallel shard (`distributed/context_parallel.py`), back in the batch's
[B, T-1] layout."""

from __future__ import annotations

import contextlib

import torch
from tensordict import TensorDict

from titanrl.data.packing import PackLayout, layout_of
from titanrl.distributed.context_parallel import CPAttention, CPShard, check_same_rows, shard_plan
from titanrl.models.attention import DocumentFlexAttention, DocumentSDPA, PackedExactAttention
from titanrl.models.batch_invariant import ExactCausalAttention, batch_invariant_mode
from titanrl.models.lora import AdaptersOff
from titanrl.models.model import AttentionBackend, Transformer
from titanrl.models.moe import PAD_ROUTE, ROUTER_ROUTE


def packed_backend(
    layout: PackLayout, device: torch.device, invariant: bool, flex: bool | None = None
) -> AttentionBackend:
    """The backend for `layout`'s rows: exact in batch-invariant mode, else FlexAttention
    (default on CUDA) or SDPA with a document mask (default elsewhere)."""
    if invariant:
        return PackedExactAttention(layout.spans)
    doc_RS = layout.doc_RS.to(device)
    use_flex = device.type == "cuda" if flex is None else flex
    return DocumentFlexAttention(doc_RS) if use_flex else DocumentSDPA(doc_RS)


def routes_in_rows(routes_BTLK: torch.Tensor, layout: PackLayout | None) -> torch.Tensor:
    """A batch's recorded MoE routes [B, T-1, L, K] (-1: none) in the model's token order [N, L, K]:
    the padded rows flattened, or the packed rows' slots (-1 on packing padding)."""
    B, T1, L, K = routes_BTLK.shape
    if layout is None:
        return routes_BTLK.reshape(B * T1, L, K).long()
    flat_NX = routes_BTLK.reshape(B * T1, L * K).long()
    out_NX = flat_NX.new_full((layout.R * layout.S, L * K), -1)
    out_NX[layout.dst_N.to(flat_NX.device)] = flat_NX[layout.src_N.to(flat_NX.device)]
    return out_NX.view(-1, L, K)


def replay_routes_LTK(routes_BTLK: torch.Tensor, layout: PackLayout | None, replay: bool) -> torch.Tensor:
    """`routes_LTK` of a batch with recorded routes: with `replay` the recorded experts, else the
    router's (`ROUTER_ROUTE`); where none was recorded (padding) `PAD_ROUTE`: the router's
    experts, left out of the aux loss and the expert loads (`models.moe`)."""
    routes_NLK = routes_in_rows(routes_BTLK, layout)
    if not replay:
        routes_NLK = torch.where(routes_NLK < 0, PAD_ROUTE, ROUTER_ROUTE)
    return routes_NLK.transpose(0, 1)  # recorded: an expert, or -1 (== PAD_ROUTE)


def forward_logprobs(
    model: Transformer | AdaptersOff,
    batch: TensorDict,
    invariant: bool,
    chunk_tokens: int,
    with_entropy: bool = False,
    packing: str = "off",
    replay_routes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs of the next tokens [B, T-1], entropy or None) as the trainer computes them, at
    the loss mask's positions only (0 elsewhere: prompt tokens are not projected to the vocabulary).
    Packed (`data.packing.layout_of`: as planned, or by `packing`) or over the padded rows.
    `replay_routes`: MoE layers use the experts in batch["routes"] (routing replay)."""
    tokens_BT, mask_BT = batch["tokens"], batch["loss_mask"]
    layout = layout_of(batch, packing)
    if isinstance(model, Transformer) and model.cp_mesh is not None:
        return _cp_logprobs(model, tokens_BT, mask_BT, layout, chunk_tokens, with_entropy)
    # Routes, replayed or not, tell the MoE layers which tokens are padding.
    routes_LTK = replay_routes_LTK(batch["routes"], layout, replay_routes) if "routes" in batch.keys() else None
    if layout is None:
        backend: AttentionBackend | None = ExactCausalAttention() if invariant else None
        with batch_invariant_mode() if invariant else contextlib.nullcontext():
            return model.logprobs(
                tokens_BT[:, :-1],
                tokens_BT[:, 1:],
                chunk_tokens,
                with_entropy,
                backend=backend,
                mask_BT=mask_BT,
                routes_LTK=routes_LTK,
            )
    inputs_RS, targets_RS = layout.pack(tokens_BT[:, :-1]), layout.pack(tokens_BT[:, 1:])
    mask_RS = layout.pack(mask_BT)
    backend = packed_backend(layout, tokens_BT.device, invariant)
    with batch_invariant_mode() if invariant else contextlib.nullcontext():
        logprobs_RS, entropy_RS = model.logprobs(
            inputs_RS,
            targets_RS,
            chunk_tokens,
            with_entropy,
            backend=backend,
            mask_BT=mask_RS,
            positions_BT=layout.positions_RS.to(tokens_BT.device),
            routes_LTK=routes_LTK,
        )
    return layout.unpack(logprobs_RS), layout.unpack(entropy_RS) if entropy_RS is not None else None


def forward_values(critic: Transformer, batch: TensorDict, packing: str = "off") -> torch.Tensor:
    """A scalar-head model's value of the state before each next token [B, T-1] (0 past each
    row's length when packed), padded or packed as `forward_logprobs`."""
    tokens_BT = batch["tokens"]
    layout = layout_of(batch, packing)
    if getattr(critic, "cp_mesh", None) is not None:
        plan, cp_backend, inputs_RS, positions_RS = _cp_rows(critic, tokens_BT[:, :-1], layout)
        out_RL1 = critic(plan.shard(inputs_RS), plan.shard(positions_RS), cp_backend)
        values_RS = plan.unshard(out_RL1[..., 0].float())
        return values_RS if layout is None else layout.unpack(values_RS)
    if layout is None:
        return critic(tokens_BT[:, :-1])[..., 0].float()
    backend = packed_backend(layout, tokens_BT.device, invariant=False)
    out_RS1 = critic(layout.pack(tokens_BT[:, :-1]), layout.positions_RS.to(tokens_BT.device), backend)
    return layout.unpack(out_RS1[..., 0].float())


def _cp_rows(
    model: Transformer, inputs_BT: torch.Tensor, layout: PackLayout | None
) -> tuple[CPShard, CPAttention, torch.Tensor, torch.Tensor]:
    """Context parallelism (`titanrl.distributed.context_parallel`): this rank's shard plan of the
    rows (packed, or the padded rows as one document each), its attention backend, the inputs
    and positions of the whole rows [R, S]."""
    if layout is None:
        inputs_RS = inputs_BT
        positions_RS = torch.arange(inputs_BT.shape[1], device=inputs_BT.device).expand_as(inputs_BT)
        doc_RS = torch.zeros_like(inputs_BT)
    else:
        inputs_RS = layout.pack(inputs_BT)
        positions_RS, doc_RS = layout.positions_RS.to(inputs_BT.device), layout.doc_RS.to(inputs_BT.device)
    mesh = model.cp_mesh
    assert mesh is not None, "called under context parallelism only"
    plan = shard_plan(inputs_RS.shape[1], mesh.size(), mesh.get_local_rank(), mesh.get_group())
    check_same_rows(inputs_RS, plan)
    return plan, CPAttention(plan, doc_RS), inputs_RS, positions_RS


def _cp_logprobs(
    model: Transformer,
    tokens_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    layout: PackLayout | None,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_logprobs` over this rank's sequence shard: hidden states and the chunked vocabulary
    projection stay sharded; only the per-token logprobs (and entropy) are gathered back."""
    plan, backend, inputs_RS, positions_RS = _cp_rows(model, tokens_BT[:, :-1], layout)
    targets_RS = tokens_BT[:, 1:] if layout is None else layout.pack(tokens_BT[:, 1:])
    mask_RS = mask_BT if layout is None else layout.pack(mask_BT)
    logprobs_RL, entropy_RL = model.logprobs(
        plan.shard(inputs_RS),
        plan.shard(targets_RS),
        chunk_tokens,
        with_entropy,
        backend=backend,
        mask_BT=plan.shard(mask_RS),
        positions_BT=plan.shard(positions_RS),
    )
    logprobs, entropy = plan.unshard(logprobs_RL), plan.unshard(entropy_RL) if entropy_RL is not None else None
    if layout is not None:
        logprobs, entropy = layout.unpack(logprobs), layout.unpack(entropy) if entropy is not None else None
    return logprobs, entropy

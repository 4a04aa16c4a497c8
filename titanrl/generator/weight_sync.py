"""In-place weight sync from the trainer's (FSDP2 / TP) model into the generator's model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from titanrl.components.float8 import has_float8_all_gather
from titanrl.models.lora import LoRALinear, clean_fqn, has_lora, is_lora_key, lora_modules

if TYPE_CHECKING:
    from titanrl.generator.quantize import WeightQuantizer


def build_quantizer(mode: str, device: torch.device, dtype: torch.dtype, tp_degree: int) -> WeightQuantizer | None:
    """The generator's weight quantizer for `generator.quantize` (None for 'none'). torchao is
    imported here, only when used: its import takes seconds."""
    if mode == "none":
        return None
    from titanrl.generator.quantize import WeightQuantizer

    return WeightQuantizer(mode, device, dtype, tp_degree)


@torch.no_grad()
def copy_trainer_weights(
    generator_model: nn.Module,
    trainer_model: nn.Module,
    quantizer: WeightQuantizer | None = None,
    trainable_only: bool = False,
) -> None:
    """Copy the trainer's current weights into `generator_model`'s tensors, in place; with a
    `quantizer`, the generator's quantised weights are re-quantised from the trainer's values.

    FSDP2 units are unsharded once each (one all-gather per unit, not per parameter), which
    leaves TP shards in place: a TP shard lands on the generator's matching TP shard.
    Transiently the ranks hold the unsharded trainer weights. `trainable_only` copies only the
    parameters that require grad, each gathered on its own (no unit is unsharded): once the
    frozen ones have been copied, they cannot have changed (`can_sync_trainable_only`).
    """
    fsdp_units = [m for m in trainer_model.modules() if isinstance(m, FSDPModule)]
    if has_float8_all_gather(trainer_model) or trainable_only:
        # float8: FSDP2 would unshard float8-cast weights; trainable_only: unsharding would
        # all-gather the frozen weights too. Gather each shard that is copied instead.
        fsdp_units = []
    for unit in fsdp_units:
        unit.unshard()
    try:
        _copy_parameters(generator_model, trainer_model, quantizer, trainable_only)
    finally:
        for unit in fsdp_units:
            unit.reshard()


@torch.no_grad()
def copy_expert_bias(generator_model: nn.Module, trainer_model: nn.Module) -> None:
    """MoE routing's `expert_bias` buffers (DeepSeek-V3's auxiliary-loss-free balancing) choose
    experts as much as the router's weights do: copy them too (they are not parameters, so
    neither the parameter copy nor shared weights carry them). Replicated, never sharded."""
    dst = {clean_fqn(n): b for n, b in generator_model.named_buffers() if n.endswith("expert_bias")}
    for name, src in trainer_model.named_buffers():
        if name.endswith("expert_bias"):
            dst[clean_fqn(name)].copy_(src)


def can_sync_trainable_only(generator_model: nn.Module) -> bool:
    """Whether, after one full copy, syncs may copy only the trainer's trainable parameters: the
    generator holds each trainer parameter as it is (LoRA adapters at runtime, not merged into
    their base), so a frozen parameter's copy stays valid. A quantised base still is: it was
    quantised from the frozen weight. Merged LoRA folds the changing adapters into the base."""
    return has_lora(generator_model)


@torch.no_grad()
def share_trainer_weights(generator_model: nn.Module, trainer_model: nn.Module) -> bool:
    """Make the generator's parameters the trainer's own storage when both hold the same whole
    tensors (one rank without FSDP or TP, same dtype and device): no second copy of the weights,
    and the optimizer's in-place updates are the sync. Returns False (nothing changed) otherwise."""
    if has_lora(trainer_model) and not has_lora(generator_model):
        return False  # the generator holds merged weights (W + B A), not the trainer's W
    pairs = _matched_parameters(generator_model, trainer_model)
    for _, dst, src in pairs:
        # A quantised generator weight (a tensor subclass, as is a DTensor) holds other values.
        if (
            is_traceable_wrapper_subclass(dst)
            or isinstance(src, DTensor)
            or (src.dtype, src.shape, src.device) != (dst.dtype, dst.shape, dst.device)
        ):
            return False
    for _, dst, src in pairs:
        dst.data = src.detach()
    return True


def _matched_parameters(
    generator_model: nn.Module, trainer_model: nn.Module
) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name, generator parameter, trainer parameter) for every parameter, matched by name. A
    generator without LoRA adapters (lora.generator = 'merged') has no counterpart for the
    trainer's adapters: they are folded into their base weights (`_merged_lora_weight`)."""
    dst_params = dict(generator_model.named_parameters())
    merged = not has_lora(generator_model)
    pairs = []
    for name, src in trainer_model.named_parameters():
        name = clean_fqn(name)  # activation checkpointing and compile wrap modules; the generator's are bare
        if merged and is_lora_key(name):
            continue
        dst = dst_params.pop(name, None)
        if dst is None:
            raise ValueError(f"trainer parameter '{name}' has no counterpart in the generator")
        pairs.append((name, dst, src))
    assert not dst_params, f"generator parameters not synced: {sorted(dst_params)}"
    return pairs


def _merged_lora_weight(w_local: torch.Tensor, module: LoRALinear) -> torch.Tensor:
    """W + (alpha / r) B A on this rank's TP shard: column-wise B is sharded like W's rows and A
    replicated, row-wise A is sharded like W's columns and B replicated, so the local product is
    the local shard of the update."""
    a = _gather_data_parallel(module.lora_a.weight.detach())
    b = _gather_data_parallel(module.lora_b.weight.detach())
    return torch.addmm(w_local, b, a, alpha=module.scaling)


def _copy_parameters(
    generator_model: nn.Module, trainer_model: nn.Module, quantizer: WeightQuantizer | None, trainable_only: bool
) -> None:
    # Base weights of adapted layers, when the generator serves the merged model.
    to_merge = {} if has_lora(generator_model) else {f"{n}.weight": m for n, m in lora_modules(trainer_model)}
    assert not (trainable_only and to_merge), "merged LoRA weights change with the adapters: copy them all"
    for name, dst, src in _matched_parameters(generator_model, trainer_model):
        if trainable_only and not src.requires_grad:
            continue
        src_local = _gather_data_parallel(src.detach())
        if name in to_merge:
            src_local = _merged_lora_weight(src_local, to_merge[name])
        dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
        if is_traceable_wrapper_subclass(dst_local):  # a quantised weight (it has no data_ptr)
            quantizer.requantize_(dst_local, src_local)
            continue
        if dst_local.data_ptr() == src_local.data_ptr():
            continue  # shared storage (`share_trainer_weights`): already the trainer's values
        if src_local.shape != dst_local.shape:
            raise ValueError(
                f"'{name}': trainer shard {tuple(src_local.shape)} != generator shard "
                f"{tuple(dst_local.shape)}; trainer and generator must use the same tp and ep degrees"
            )
        dst_local.copy_(src_local)


# FSDP2's dims; "dp_shard_mod_ep" shards experts beside "ep", whose shard stays: the generator's
# experts are sharded over the same ep ranks (`Generator(ep_mesh=...)`), so each rank copies its own.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard", "dp", "dp_shard_mod_ep")


def _gather_data_parallel(t: torch.Tensor) -> torch.Tensor:
    """Local tensor of `t` after all-gathering only its data-parallel mesh dims."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or ()
    placements = [
        Replicate() if i < len(names) and names[i] in DATA_PARALLEL_DIMS else p for i, p in enumerate(t.placements)
    ]
    return t.redistribute(t.device_mesh, placements).to_local()


def weight_storage(model: nn.Module) -> list[torch.Tensor]:
    """The plain tensors that hold `model`'s weights: a DTensor's local shard, a quantised
    weight's inner tensors (int8 / float8 data, scales), else the parameter itself: what
    offloading moves and what memory accounting counts."""
    out = []
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if is_traceable_wrapper_subclass(local):
            out.extend(getattr(local, name) for name in local.__tensor_flatten__()[0])
        else:
            out.append(local)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s (local) weights as stored: quantised ones at their storage dtype."""
    return sum(t.numel() * t.element_size() for t in weight_storage(model))

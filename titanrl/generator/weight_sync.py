"""In-place weight sync from the trainer's (FSDP2 / TP) model into the generator's model."""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate


@torch.no_grad()
def copy_trainer_weights(generator_model: nn.Module, trainer_model: nn.Module) -> None:
    """Copy the trainer's current weights into `generator_model`'s tensors, in place.

    FSDP2 units are unsharded once each (one all-gather per unit, not per parameter), which
    leaves TP shards in place: a TP shard lands on the generator's matching TP shard.
    Transiently the ranks hold the unsharded trainer weights.
    """
    fsdp_units = [m for m in trainer_model.modules() if isinstance(m, FSDPModule)]
    for unit in fsdp_units:
        unit.unshard()
    try:
        _copy_parameters(generator_model, trainer_model)
    finally:
        for unit in fsdp_units:
            unit.reshard()


@torch.no_grad()
def share_trainer_weights(generator_model: nn.Module, trainer_model: nn.Module) -> bool:
    """Make the generator's parameters the trainer's own storage when both hold the same whole
    tensors (one rank without FSDP or TP, same dtype and device): no second copy of the weights,
    and the optimizer's in-place updates are the sync. Returns False (nothing changed) otherwise."""
    pairs = _matched_parameters(generator_model, trainer_model)
    for _, dst, src in pairs:
        if isinstance(src, DTensor) or isinstance(dst, DTensor) or (src.dtype, src.shape, src.device) != (
                dst.dtype, dst.shape, dst.device):
            return False
    for _, dst, src in pairs:
        dst.data = src.detach()
    return True


def _matched_parameters(generator_model: nn.Module, trainer_model: nn.Module
                        ) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(name, generator parameter, trainer parameter) for every parameter, matched by name."""
    dst_params = dict(generator_model.named_parameters())
    pairs = []
    for name, src in trainer_model.named_parameters():
        # Activation checkpointing and torch.compile wrap modules; the generator's are bare.
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        dst = dst_params.pop(name, None)
        if dst is None:
            raise ValueError(f"trainer parameter '{name}' has no counterpart in the generator")
        pairs.append((name, dst, src))
    assert not dst_params, f"generator parameters not synced: {sorted(dst_params)}"
    return pairs


def _copy_parameters(generator_model: nn.Module, trainer_model: nn.Module) -> None:
    for name, dst, src in _matched_parameters(generator_model, trainer_model):
        src_local = _gather_data_parallel(src.detach())
        dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
        if dst_local.data_ptr() == src_local.data_ptr():
            continue  # shared storage (`share_trainer_weights`): already the trainer's values
        if src_local.shape != dst_local.shape:
            raise ValueError(
                f"'{name}': trainer shard {tuple(src_local.shape)} != generator shard "
                f"{tuple(dst_local.shape)}; trainer and generator must use the same tp degree"
            )
        dst_local.copy_(src_local)


def _gather_data_parallel(t: torch.Tensor) -> torch.Tensor:
    """Local tensor of `t` after all-gathering only its data-parallel mesh dims."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or ()
    placements = [
        Replicate() if i < len(names) and names[i] in ("dp_replicate", "dp_shard", "dp") else p
        for i, p in enumerate(t.placements)
    ]
    return t.redistribute(t.device_mesh, placements).to_local()

"""Float8 training of the transformer blocks' linear layers through torchao (TorchTitan's
[float8] converter).

`convert_to_float8` swaps the block projections (wq, wk, wv, wo, w1, w2, w3) of a meta-device
`Transformer` for torchao `Float8Linear`s before `parallelize_model`: weights stay in the
trainer's precision (they are what the optimizer, checkpoints and the generator see), and every
matmul casts its inputs to float8 with dynamic scales (`torch._scaled_mm`). Embeddings, the final
norm and the output head are never converted: `Transformer.logprobs` reads `output.weight`
directly, so a float8 output layer would not be used by the loss anyway.

With `enable_fsdp_float8_all_gather` the weights are wrapped in torchao's
`WeightWithDynamicFloat8CastTensor`, so FSDP2 all-gathers float8 shards (1 byte per weight, not 2 or 4)
and each rank computes the global amax with one all-reduce per weight; after every optimizer step
`precompute_float8_scales` can replace those all-reduces with one for all weights.

Tensor parallelism needs nothing special: the plain column/row-wise styles shard a Float8Linear
like an nn.Linear. torchao's float8 TP styles (activations cast before the sequence-parallel
all-gather) are not wired in: they need NCCL (gloo cannot all-gather float8).
"""

import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import DTensor

from titanrl.config.training import Float8 as Float8Config
from titanrl.models.model import Transformer

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

logger = logging.getLogger(__name__)

BLOCKS_PREFIX = "layers."
"""Only linears below this FQN prefix (the transformer blocks) are candidates."""

FLOAT8_DIM_MULTIPLE = 16
"""`torch._scaled_mm` on CUDA needs both weight dims to be multiples of 16."""


def float8_linear_config(config: Float8Config) -> "Float8LinearConfig":
    """torchao's `Float8LinearConfig` for the [float8] section."""
    # Imported here: torchao is only needed (and only loaded, which is slow) when float8 is on.
    from torchao.float8 import Float8LinearConfig

    torchao_config = Float8LinearConfig.from_recipe_name(config.recipe)
    return replace(
        torchao_config,
        enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
        emulate=config.emulate,
    )


def _skip_reason(fqn: str, module: nn.Linear, config: Float8Config) -> str:
    """Why the block linear `fqn` stays in high precision ('' when it is converted)."""
    if any(name in fqn for name in config.filter_fqns):
        return "filter_fqns"
    out_features, in_features = module.weight.shape
    if out_features % FLOAT8_DIM_MULTIPLE or in_features % FLOAT8_DIM_MULTIPLE:
        return f"shape {out_features}x{in_features} not a multiple of {FLOAT8_DIM_MULTIPLE}"
    return ""


def _check_supported(model: nn.Module) -> None:
    """Reject block linears that float8 cannot replace, naming the fix."""
    if any(getattr(module, "moe", None) is not None for module in model.modules()):
        raise ValueError(
            "[float8] does not support mixture-of-experts models yet (the routed experts are grouped "
            "weights, not linear layers, and would stay in high precision): set float8.enable = false"
        )
    for fqn, module in model.named_modules():
        if fqn.startswith(BLOCKS_PREFIX) and isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            # A subclass (e.g. LoRALinear) carries behaviour that Float8Linear would drop.
            raise ValueError(
                f"[float8] cannot convert '{fqn}' ({type(module).__name__}, not a plain nn.Linear) to "
                "float8: float8 training of adapted layers is not supported; set lora.enable = false "
                "or float8.enable = false"
            )


def convert_to_float8(model: nn.Module, config: Float8Config, fsdp_sharded: bool = True) -> list[str]:
    """Swap the block linears of `model` (on any device, typically meta) for torchao
    `Float8Linear`s, in place. Returns the converted FQNs.

    `fsdp_sharded`: whether FSDP2 will shard the weights (dp_shard > 1). Without sharding nothing
    is all-gathered, so `enable_fsdp_float8_all_gather` is dropped: its weight wrapper would only
    keep a one-rank generator from sharing the trainer's weights (it has no storage of its own).

    A linear is skipped (and counted in the log) when its FQN contains one of
    `config.filter_fqns` or a weight dim is not a multiple of 16; a model where nothing is
    converted is an error, since the job would silently train in high precision.
    """
    _check_supported(model)
    from torchao.float8 import convert_to_float8_training

    converted: list[str] = []
    skipped: dict[str, str] = {}

    def module_filter_fn(module: nn.Module, fqn: str) -> bool:
        if not (fqn.startswith(BLOCKS_PREFIX) and isinstance(module, nn.Linear)):
            return False
        reason = _skip_reason(fqn, module, config)
        if reason:
            skipped[fqn] = reason
            return False
        converted.append(fqn)
        return True

    if not fsdp_sharded:
        config = replace(config, enable_fsdp_float8_all_gather=False)
    convert_to_float8_training(model, module_filter_fn=module_filter_fn, config=float8_linear_config(config))
    if not converted:
        raise ValueError(
            f"[float8] no block linear was converted (skipped: {skipped}); float8 needs weight dims "
            "that are multiples of 16 and FQNs outside float8.filter_fqns, or set float8.enable = false"
        )
    logger.info(
        "float8: %d linears converted (recipe=%s, fsdp_float8_all_gather=%s), %d kept in high precision%s",
        len(converted),
        config.recipe,
        config.enable_fsdp_float8_all_gather,
        len(skipped),
        f": {sorted(set(skipped.values()))}" if skipped else "",
    )
    return converted


def precompute_float8_scales(model: nn.Module, config: Float8Config) -> None:
    """After `optimizer.step()`: the float8 scales of all FSDP-sharded weights from one
    all-reduce of their amaxes, instead of one all-reduce per weight at the next all-gather.

    Once called, the precomputed scales are used by every later all-gather, so it must be called
    after *every* optimizer step (and after any other in-place change of the weights, such as a
    checkpoint load), else weights are cast with stale scales. A no-op unless float8 with FSDP
    float8 all-gather is on.
    """
    if not (config.enable and config.enable_fsdp_float8_all_gather):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def reshard_float8_blocks_after_forward(model: Transformer) -> None:
    """Make every FSDP2 block of a float8-all-gather `model` reshard after its forward.

    Its unsharded weights are float8 tensors that checkpointing and weight copies cannot read
    (torchao: 'attempting to run aten.abs.default, this is not supported'). FSDP2 keeps the last
    block unsharded after a forward for the backward (`apply_fsdp`), and a forward-only model
    (the reference) never runs that backward.
    """
    from torch.distributed.fsdp import FSDPModule

    for block in model.blocks():
        if isinstance(block, FSDPModule):
            block.set_reshard_after_forward(True)


def has_float8_all_gather(model: nn.Module) -> bool:
    """Whether FSDP2 unshards `model`'s float8 linears as float8 (`enable_fsdp_float8_all_gather`):
    its unsharded weights are then float8-cast copies, not the trainer's values, so a weight sync
    must gather the high-precision shards per parameter instead of unsharding the FSDP units."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:  # torchao never loaded: no float8 weights, and no slow import here
        return False
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, fsdp_utils.WeightWithDynamicFloat8CastTensor):
            return True
    return False

"""Tensor parallelism of Qwen3.5's gated DeltaNet layers (`models/gated_deltanet.py`): each tp
rank holds whole key-head groups, i.e. linear_num_key_heads / tp key heads and the
linear_num_value_heads / tp value heads they serve.

titanrl keeps `in_proj_qkv`'s rows (and `conv1d`'s channels) grouped by key head,
[q_h | k_h | v of h's value heads] per head h, so a plain row shard (ColwiseParallel, Shard(0))
gives a rank its groups' q, k and v together; on HF's [all q | all k | all v] order it would give
rank 0 all of q and part of k instead. `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log` and
`dt_bias` are per value head, in key-head-group order, so Shard(0) splits them the same way;
`out_proj` is row-wise. The gated RMSNorm is per value head: its weight is replicated and its
inputs are DTensors sharded on the head dim, so DTensor all-reduces the weight's gradient.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)

from titanrl.models.gated_deltanet import GatedDeltaNet


def linear_attn_tp_plan(residual: Placement, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The block-plan entries of a gated DeltaNet layer (they replace the `attention.*` ones).
    With sequence parallelism its input is all-gathered to a plain tensor first: the layer
    gathers its sequences' tokens by index, which a sequence shard cannot do."""
    heads = Shard(1)  # the value-head dim of the norm's [tokens, heads, value dim] inputs
    plan: dict[str, ParallelStyle] = {
        "linear_attn.in_proj_qkv": ColwiseParallel(),
        "linear_attn.in_proj_z": ColwiseParallel(),
        "linear_attn.in_proj_b": ColwiseParallel(),
        "linear_attn.in_proj_a": ColwiseParallel(),
        "linear_attn.norm": PrepareModuleInputOutput(
            input_layouts=(heads, heads),
            desired_input_layouts=(heads, heads),
            use_local_input=False,
            output_layouts=(heads,),
            desired_output_layouts=(heads,),
            use_local_output=True,
        ),
        "linear_attn.out_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel),
    }
    if sequence_parallel:
        plan["linear_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )
    return plan


def shard_linear_attn_params(layer: GatedDeltaNet, tp_mesh: DeviceMesh) -> None:
    """The parameters no linear style covers: the conv weight, `A_log` and `dt_bias` sharded by
    key-head group (Shard(0)), the gated norm's weight replicated."""
    for module, name, placement in (
        (layer.conv1d, "weight", Shard(0)),
        (layer, "A_log", Shard(0)),
        (layer, "dt_bias", Shard(0)),
        (layer.norm, "weight", Replicate()),
    ):
        param = getattr(module, name)
        dtensor = distribute_tensor(param.detach(), tp_mesh, [placement])
        setattr(module, name, nn.Parameter(dtensor, requires_grad=param.requires_grad))

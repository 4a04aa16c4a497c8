from titanrl.distributed.parallel_dims import ParallelDims, device_type
from titanrl.distributed.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    apply_tp,
    clip_grad_norm_,
    parallelize_model,
)
from titanrl.distributed.utils import all_reduce_values, dp_max, dp_sum, init_distributed, set_determinism

__all__ = [
    "ParallelDims",
    "all_reduce_values",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "clip_grad_norm_",
    "device_type",
    "dp_max",
    "dp_sum",
    "init_distributed",
    "parallelize_model",
    "set_determinism",
]

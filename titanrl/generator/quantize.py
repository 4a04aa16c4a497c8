"""Quantised rollout: the generator's block linears hold torchao quantised weights (int8
weight-only, or float8 weights and activations), re-quantised from the trainer's full-precision
weights at every sync; the trainer itself never changes precision.

What is quantised: every `nn.Linear` inside the transformer blocks (attention q/k/v/o and the
MLP w1/w2/w3), which hold almost all the weights a decode step reads for a model whose blocks
dominate. What stays in the generator's precision:
- the embedding (a lookup: nothing to multiply, and its rows are read a few per token);
- the LM head `output`: its logits are the sampling distribution and the behaviour logprobs
  themselves, so its error would go straight into the sampler/trainer mismatch instead of being
  damped by the residual stream and the final norm (the usual practice: vLLM, GPTQ and AWQ
  checkpoints keep lm_head unquantised); and in tied models (Qwen2.5 0.5B-3B, Qwen3 <= 4B) it
  *is* the embedding matrix, so an int8 head would be a second copy next to it, not a saving.
  At a real vocabulary on a small model the head is a large share of the weights, which bounds
  the memory saved there (`tests/test_quantized_rollout.py` measures it).

A sync writes the new quantised values into the tensors the quantised weight already holds
(`qdata`, `scale`, ...): no full-precision second copy is kept, and the tensors keep their
addresses, so a compiled decode step (and its CUDA graphs) stays valid across syncs.

This module imports torchao (seconds, and warnings about optional kernels): the engine imports
it only when `generator.quantize` is not 'none'.
"""

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Int8WeightOnlyConfig,
    PerRow,
    PerTensor,
    quantize_,
)
from torchao.utils import TorchAOBaseTensor

from titanrl.config.model import LORA_TARGETS

FP8_MIN_CAPABILITY = (8, 9)
BLOCK_PROJECTIONS = LORA_TARGETS  # the seven linears of a block, one list for LoRA and quantisation


def check_quantize_supported(mode: str, device: torch.device, tp_degree: int) -> None:
    """Reject combinations the quantised generator cannot run, naming the fix."""
    if mode not in ("int8", "fp8"):
        raise ValueError(f"[generator] quantize must be 'none', 'int8' or 'fp8', got '{mode}'")
    if tp_degree > 1:
        # torchao's Int8Tensor / Float8Tensor are plain-tensor subclasses: TP's DTensor weights
        # (and the DTensor matmul decomposition of a sharded linear) are not supported by them.
        raise ValueError(
            f"[generator] quantize='{mode}' does not support tensor parallelism (tp={tp_degree}): torchao's "
            "quantised tensors cannot be DTensor shards; set generator.quantize='none' or parallelism.tp=1"
        )
    if mode == "fp8":
        capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
        if not capable:
            raise ValueError(
                f"[generator] quantize='fp8' needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or "
                f"newer); the generator runs on '{device}'. Use generator.quantize='int8' there"
            )


def _config(mode: str, dtype: torch.dtype):
    """The torchao config of `mode`. `set_inductor_config=False`: torchao would otherwise flip
    process-wide inductor options (coordinate-descent tuning, ...) that slow the trainer's compile
    too and change no numerics of ours."""
    if mode == "int8":
        # Symmetric, one scale per output channel (torchao's default granularity).
        return Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    # Row-wise fp8 scales are more accurate but torchao implements them for bf16 weights only.
    granularity = PerRow() if dtype == torch.bfloat16 else PerTensor()
    return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False)


def _is_block_linear(module: nn.Module, fqn: str) -> bool:
    """A block projection, by name: not the LM head, not LoRA's small adapters (`lora_a` /
    `lora_b`, kept in full precision like their trainer copies; the frozen base is quantised)."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.") and fqn.rsplit(".", 1)[-1] in BLOCK_PROJECTIONS


def is_quantized(t: torch.Tensor) -> bool:
    """Whether `t` is one of torchao's quantised tensors (a generator weight `WeightQuantizer` owns)."""
    return isinstance(t, TorchAOBaseTensor)


class WeightQuantizer:
    """Quantises the generator's block linears once (`quantize_model_`) and re-quantises one
    weight from the trainer's value at every sync (`requantize_`)."""

    def __init__(self, mode: str, device: torch.device, dtype: torch.dtype, tp_degree: int = 1) -> None:
        check_quantize_supported(mode, device, tp_degree)
        self.mode = mode
        self.config = _config(mode, dtype)

    def quantize_model_(self, model: nn.Module) -> int:
        """Replace the block linears' weights by quantised ones (values: whatever they hold now;
        the first sync overwrites them). Returns how many were quantised."""
        quantize_(model, self.config, filter_fn=_is_block_linear)
        count = sum(is_quantized(m.weight) for fqn, m in model.named_modules() if _is_block_linear(m, fqn))
        if count == 0:
            # fp8 silently skips weights whose dimensions are not multiples of 16.
            raise ValueError(
                f"[generator] quantize='{self.mode}' left every linear of the model unquantised "
                "(float8 needs both dimensions of a weight to be multiples of 16); use 'int8' or 'none'"
            )
        return count

    @torch.no_grad()
    def requantize_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (a quantised weight) := quantise(src), written into dst's own tensors in place."""
        holder = nn.Linear(src.shape[1], src.shape[0], bias=False, device="meta")
        holder.weight = nn.Parameter(src.detach().to(dst.dtype), requires_grad=False)
        quantize_(holder, self.config)
        new = holder.weight
        assert type(new) is type(dst), f"re-quantised to {type(new).__name__}, the generator holds {type(dst).__name__}"
        assert is_traceable_wrapper_subclass(dst), "a quantised weight is a tensor subclass of inner tensors"
        names, _ = dst.__tensor_flatten__()
        for name in names:
            getattr(dst, name).copy_(getattr(new, name))

"""Per-rank memory of a job's models, read from the real parallelised models built on the meta
device under torch's fake process group: the shapes of every rank's shards (FSDP2's padding
included) come from the same `build_meta_model` and generator code a run uses, and nothing is
allocated.

One rank at a time: `fake_world(world, rank)` makes this process rank `rank` of a `world`-rank
group whose collectives return at once, so a 1024-rank mesh is built in a second on a laptop.
"""

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanrl.algorithms import get_algorithm
from titanrl.components.model_builder import build_meta_model
from titanrl.config.job_config import JobConfig
from titanrl.config.training import Optimizer as OptimizerConfig
from titanrl.distributed import parallel_dims
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.distributed.parallelize import apply_ep, apply_tp
from titanrl.generator.generator import kv_cache_dims
from titanrl.generator.kv_cache import KVCachePool
from titanrl.generator.state_slots import StateSlots
from titanrl.generator.window_pages import kv_layers, window_pool_blocks
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import read_hf_config
from titanrl.models.lora import add_lora
from titanrl.models.model import Transformer

STATE_TENSORS = {"AdamW": 2, "Adam": 2, "SGD": 0}
"""Optimizer state tensors per parameter (`components/optimizer.py`: AdamW / Adam keep exp_avg and
exp_avg_sq, each a zeros_like of the parameter's local shard; SGD without momentum keeps none)."""

STEP_BYTES = 4
"""AdamW / Adam also keep one float32 `step` tensor per parameter."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank `rank` of a `world_size`-rank fake process group, for the block."""
    assert not dist.is_initialized(), "a plan is made before (or without) the job's own process group"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # A CPU mesh even on a GPU node (the launcher's pre-flight): a CUDA mesh would set this
        # process's device from the fake rank and create a context before any rank starts.
        with warnings.catch_warnings(), mock.patch.object(parallel_dims, "device_type", return_value="cpu"):
            warnings.simplefilter("ignore", UserWarning)  # torch's notes on slicing flattened mesh dims
            yield
    finally:
        dist.destroy_process_group()


@dataclass
class ModelBytes:
    """One model's bytes on one rank."""

    params: int
    """Parameter storage of this rank's shards (FSDP2 pads a shard to the largest one)."""

    grads: int
    """Gradients of the trainable parameters (the same shards)."""

    optimizer: int
    """Optimizer state of the trainable parameters."""

    buffers: int
    """Non-parameter tensors (RoPE tables)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' storage on this rank, as a run measures them."""
    return sum(_local(p).untyped_storage().nbytes() for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the trainable parameters' gradients: FSDP2 reduce-scatters into padded shards,
    one per parameter, of the parameter's dtype."""
    return sum(_local(p).untyped_storage().nbytes() for p in model.parameters() if p.requires_grad)


def optimizer_bytes(model: nn.Module, name: str) -> int:
    """Bytes of the optimizer state: `STATE_TENSORS[name]` unpadded local shards per trainable
    parameter, and a float32 step tensor each for Adam(W)."""
    trainable = [_local(p) for p in model.parameters() if p.requires_grad]
    states = sum(p.numel() * p.element_size() for p in trainable) * STATE_TENSORS[name]
    return states + (STEP_BYTES * len(trainable) if STATE_TENSORS[name] else 0)


def step_temp_bytes(model: nn.Module, config: OptimizerConfig) -> int:
    """Temporaries of Adam(W)'s step: 'foreach' computes sqrt(exp_avg_sq) for every parameter at
    once (one state's worth), 'for-loop' for one parameter at a time, 'fused' in its kernel."""
    if not STATE_TENSORS[config.name] or config.implementation == "fused":
        return 0
    sizes = [_local(p).numel() * _local(p).element_size() for p in model.parameters() if p.requires_grad]
    return sum(sizes) if config.implementation == "foreach" else max(sizes, default=0)


def buffer_bytes(model: nn.Module) -> int:
    return sum(_local(b).numel() * b.element_size() for b in model.buffers())


def model_bytes(model: nn.Module, optimizer: str | None) -> ModelBytes:
    """A trained model's (with `optimizer`) or a frozen one's bytes on this rank."""
    if optimizer is None:
        return ModelBytes(param_bytes(model), 0, 0, buffer_bytes(model))
    return ModelBytes(param_bytes(model), grad_bytes(model), optimizer_bytes(model, optimizer), buffer_bytes(model))


def mesh_dims(config: JobConfig, world_size: int) -> ParallelDims:
    p = config.parallelism
    return ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world_size, p.ep, p.cp)


@dataclass
class RankModels:
    """The meta models one rank holds: the policy, and what the config adds beside it."""

    policy: Transformer
    reference: Transformer | None
    critic: Transformer | None
    reward_model: Transformer | None
    generator: Transformer | None
    """The generator's own copy; None where it shares the policy's storage (one rank, float32)."""


def build_rank_models(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims) -> RankModels:
    """The models the recipe builds (`RLRecipe.__init__`, in its order; DPO: its reference), on
    the meta device (`fake_world`)."""
    lora = config.lora if config.lora.enable else None
    policy = build_meta_model(args, dims, config, lora=lora)
    reference = critic = reward = None
    kl = config.job.recipe == "rl" and config.algorithm.kl_coef > 0
    if (kl or config.job.recipe == "dpo") and lora is None:  # a LoRA policy's reference is its base
        reference = build_meta_model(args, dims, config).requires_grad_(False)
    if config.job.recipe == "rl":
        algorithm = get_algorithm(config.algorithm.name)
        if algorithm.needs_critic:
            critic_args = read_hf_config(config.critic.hf_checkpoint) if config.critic.hf_checkpoint else args
            critic = build_meta_model(dataclasses.replace(critic_args, num_labels=1), dims, config)
        if config.reward.model_path:
            reward_args = read_hf_config(config.reward.model_path)
            reward = build_meta_model(reward_args, dims, config, float8=False).requires_grad_(False)
    generator = build_generator_model(config, args, dims, policy) if config.job.recipe == "rl" else None
    return RankModels(policy, reference, critic, reward, generator)


def generator_dtype(config: JobConfig) -> torch.dtype:
    return getattr(torch, config.training.mixed_precision_param)


def shares_weights(config: JobConfig, policy: nn.Module) -> bool:
    """`Generator.share_weights`' rule: whole, unsharded trainer tensors of the generator's dtype,
    no quantisation, and no merged LoRA copy."""
    if config.generator.quantize != "none" or (config.lora.enable and config.lora.generator == "merged"):
        return False
    return all(not isinstance(p, DTensor) and p.dtype == generator_dtype(config) for p in policy.parameters())


def build_generator_model(
    config: JobConfig, args: TransformerModelArgs, dims: ParallelDims, policy: nn.Module
) -> Transformer | None:
    """`ModelRunner._build_model` on the meta device: TP without sequence parallelism, experts
    over ep, in the training compute dtype; None where the generator shares the policy's weights."""
    if shares_weights(config, policy):
        return None
    with torch.device("meta"):
        model = Transformer(args)
        if config.lora.enable and config.lora.generator == "runtime":
            add_lora(model, config.lora)
    if dims.tp_enabled:
        apply_tp(model, dims.world_mesh["tp"], sequence_parallel=False)
    if dims.ep_enabled:
        apply_ep(model, dims.world_mesh["ep"])
    return model.to(generator_dtype(config)).requires_grad_(False)


def kv_block_bytes(config: JobConfig, args: TransformerModelArgs, tp: int) -> tuple[int, int]:
    """(bytes of one main-pool block, of one window-pool block) over all layers (`Generator._bytes_per_block`)."""
    heads, head_dim, latent = kv_cache_dims(args, tp)
    dtype, block = generator_dtype(config), config.generator.block_size
    main, window = (sum(kv_layers(args, in_window_pool=w)) for w in (False, True))
    return (
        max(1, KVCachePool.bytes_per_block(main, block, heads, head_dim, dtype, latent=latent)),
        max(1, KVCachePool.bytes_per_block(window, block, heads, head_dim, dtype, latent=latent)),
    )


@dataclass
class KVPool:
    blocks: int
    """Main-pool blocks: generator.num_blocks, or what kv_cache_memory_fraction of the free memory holds."""

    bytes: int
    """Main and window pools, and a hybrid model's state slots."""

    tokens: int
    """Tokens the main pool holds (blocks x block_size)."""


def kv_pool(config: JobConfig, args: TransformerModelArgs, tp: int, free_bytes: int) -> KVPool:
    """The generator's pool: the blocks the config asks for, or `blocks_from_memory`'s share of
    `free_bytes` (the memory left when the generator is built), rounded as it rounds."""
    g = config.generator
    main, window = kv_block_bytes(config, args, tp)
    slots = StateSlots.bytes_for(args, g.max_num_seqs, generator_dtype(config), tp) if args.has_linear_layers else 0
    window_cap = window_pool_blocks(args, g, num_blocks=2**62)
    blocks = g.num_blocks
    if not blocks:
        blocks = max(1, (int(max(free_bytes, 0) * g.kv_cache_memory_fraction) - slots - window_cap * window) // main)
        blocks &= ~((1 << max(0, blocks.bit_length() - 4)) - 1)
    window_blocks = window_pool_blocks(args, g, blocks)
    return KVPool(blocks, blocks * main + window_blocks * window + slots, blocks * g.block_size)

"""Apply TP, EP, activation checkpointing, compile and FSDP2 to a `Transformer`, in that order.

The order is TorchTitan's: TP first (it swaps parameters to DTensors on the tp mesh), then EP
(experts to DTensors on the ep mesh), then AC wraps blocks, then each block is compiled, then
FSDP2 shards what TP / EP left (2-D DTensors when both are on).
"""

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanrl.config.job_config import JobConfig
from titanrl.distributed.context_parallel import validate_cp
from titanrl.distributed.expert_parallel import ExpertParallel
from titanrl.distributed.gated_deltanet_tp import linear_attn_tp_plan, shard_linear_attn_params
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.models.gated_deltanet import check_parallelism as check_hybrid_parallelism
from titanrl.models.lora import LoRALinear, freeze_base, has_lora
from titanrl.models.model import Transformer

# "float32": no cast, parameters compute in their own dtype (float32 master weights; a float64
# model, which the parity tests build, stays float64).
_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def parallelize_model(model: Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> Transformer:
    """Also records the cp group on the model (`model.cp_mesh`, None without context parallelism):
    `titanrl.data.batch_forward` shards the rows of every training forward over it."""
    if parallel_dims.cp > 1 and model.args.kv_lora_rank:  # DeepSeek-V3
        raise ValueError(
            f"[parallelism] cp = {parallel_dims.cp} does not support multi-head latent attention (DeepSeek-V3): "
            "context parallelism all-gathers per-head K / V in `Attention`, which MLA (models/mla.py) "
            "does not use; set cp = 1"
        )
    validate_cp(job_config, parallel_dims.cp, model.args.moe_num_experts > 0)
    check_hybrid_parallelism(model.args, parallel_dims.tp, parallel_dims.cp)  # Qwen3.5: tp, cp refused
    model.cp_mesh = parallel_dims.cp_mesh if parallel_dims.cp_enabled else None
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.world_mesh["tp"])
    if parallel_dims.ep_enabled:
        apply_ep(model, parallel_dims.world_mesh["ep"])
    if has_lora(model):
        # After TP (its styles make new parameters, trainable by default), before FSDP2 groups them.
        freeze_base(model)
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint.mode, job_config.activation_checkpoint.selective_ac_option)
    if job_config.compile.enable:
        apply_compile(model, job_config.compile.backend)
    # Mixed precision is FSDP2's policy (float32 master weights, bf16 compute): one rank gets it
    # from FSDP2 over a one-rank mesh, which shards nothing.
    if parallel_dims.fsdp_enabled or job_config.training.mixed_precision_param != "float32":
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh,
            param_dtype=_DTYPES[job_config.training.mixed_precision_param],
            reduce_dtype=_DTYPES[job_config.training.mixed_precision_reduce],
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            expert_mesh=parallel_dims.expert_fsdp_mesh if parallel_dims.ep_enabled else None,
        )
    return model


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (`titanrl.distributed.expert_parallel`)."""
    ep, num_experts = ep_mesh.size(), model.args.moe_num_experts
    if num_experts == 0:
        raise ValueError(f"[parallelism] ep = {ep} needs a mixture-of-experts model; this one is dense: set ep = 1")
    if num_experts % ep:
        raise ValueError(
            f"[parallelism] ep ({ep}) must divide the number of experts ({num_experts}); choose another ep degree"
        )
    for block in model.blocks():
        if block.moe is not None:
            parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Megatron-style TP: q/k/v and w1/w3 column-wise, wo and w2 row-wise, vocab-sharded embeddings.

    With `sequence_parallel` (training), activations between blocks are sharded on the sequence
    dim (Shard(1)) and the norms run on their shard; attention and the MLP all-gather the
    sequence and reduce-scatter back. The residual stream stays a DTensor (use_local_output=False):
    with local tensors at block boundaries AOTAutograd fails in backward in torch 2.13.
    Without it (the generator), activations are replicated and norms stay plain modules.
    """
    tp = tp_mesh.size()
    args = model.args
    if args.n_heads % tp or args.n_kv_heads % tp or args.hidden_dim % tp or args.vocab_size % tp:
        raise ValueError(
            f"tp={tp} must divide n_heads ({args.n_heads}), n_kv_heads ({args.n_kv_heads}), "
            f"hidden_dim ({args.hidden_dim}) and vocab_size ({args.vocab_size}); choose another tp degree"
        )
    residual = Shard(1) if sequence_parallel else Replicate()
    root_plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sequence_parallel
        ),
    }
    if args.num_labels:
        # A score head has a handful of rows: replicate it and gather the sequence after it.
        distribute_module(model.output, tp_mesh)
        root_plan["output"] = PrepareModuleOutput(
            output_layouts=residual, desired_output_layouts=Replicate(), use_local_output=True
        )
    else:
        # Replicated logits keep the loss code free of DTensors; the vocab shard of the weight
        # is still 1/tp of the memory.
        root_plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    if args.ties_output:
        # Both styles shard the shared matrix on dim 0 (vocab); re-tie to one DTensor.
        model.output.weight = model.tok_embeddings.weight

    for block in model.blocks():
        block_plan = _block_tp_plan(args, residual, sequence_parallel, block.moe_enabled)
        if block.linear_attn is not None:  # Qwen3.5's gated DeltaNet in place of attention
            block_plan = {k: v for k, v in block_plan.items() if k.split(".")[0] != "attention"}
            block_plan |= linear_attn_tp_plan(residual, sequence_parallel)
        plan = {
            path: LoRAParallel(style) if isinstance(block.get_submodule(path), LoRALinear) else style
            for path, style in block_plan.items()
        }
        parallelize_module(block, tp_mesh, plan)
        if block.linear_attn is not None:
            shard_linear_attn_params(block.linear_attn, tp_mesh)
        sinks = getattr(block.attention, "sinks", None)  # MLA and linear layers have none
        if sinks is not None:  # gpt-oss: each rank's heads' sinks (Shard(0), as wq's heads)
            assert block.attention is not None, "sinks belong to an attention layer"
            block.attention.sinks = nn.Parameter(
                distribute_tensor(sinks, tp_mesh, [Shard(0)]), requires_grad=sinks.requires_grad
            )


class LoRAParallel(ParallelStyle):
    """A column- or row-wise style for a `LoRALinear`: the base weight as the style shards it,
    the adapters so that their product has the base weight's placement. Column-wise (W Shard(0)):
    A [r, in] replicated, B [out, r] Shard(0). Row-wise (W Shard(1)): A Shard(1), B replicated,
    so x_shard A_shard^T is a partial sum that the style's output reduction adds up with x W^T."""

    def __init__(self, base: ColwiseParallel | RowwiseParallel) -> None:
        super().__init__()
        self.base = base

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, LoRALinear), type(module)
        lora_a, lora_b, dropout = module.lora_a, module.lora_b, module.lora_dropout
        # The base styles treat the module's children as linears of their own: detach them.
        del module.lora_a, module.lora_b, module.lora_dropout
        parallelize_module(module, device_mesh, self.base)
        colwise = isinstance(self.base, ColwiseParallel)
        placements = (Replicate(), Shard(0)) if colwise else (Shard(1), Replicate())
        for child, placement in zip((lora_a, lora_b), placements):
            child.weight = nn.Parameter(
                distribute_tensor(child.weight, device_mesh, [placement]), requires_grad=child.weight.requires_grad
            )
        module.lora_a, module.lora_b, module.lora_dropout = lora_a, lora_b, dropout
        return module


def _block_tp_plan(args, residual, sequence_parallel: bool, moe: bool) -> dict:
    """The per-block TP plan: projections column/row-wise; with sequence parallelism the norms run
    on sequence shards and attention / MLP inputs are all-gathered first.

    A mixture of experts is not tensor-parallel: every tp rank runs it on the whole (gathered)
    sequence with plain weights (expert parallelism is what shards the experts), and its output
    goes back to the residual's sequence shard."""
    block_plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel),
    }
    if args.kv_lora_rank:  # MLA (`models/mla.py`): heads split, latent projections replicated
        block_plan = {
            "attention.wq_b" if args.q_lora_rank else "attention.wq": ColwiseParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": block_plan["attention.wo"],
        }
    if not moe:
        block_plan.update(
            {
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=residual, use_local_output=not sequence_parallel),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    if sequence_parallel and moe:
        block_plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=False,
        )
    if sequence_parallel:
        block_plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                    use_local_output=bool(args.kv_lora_rank),  # MLA's replicated projections take plain x
                ),
                "ffn_norm": SequenceParallel(),
            }
        )
        if not moe:
            block_plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        if args.qk_norm:
            # q/k are [B, T, heads, head_dim] with heads sharded; the norm weight is replicated
            # and its gradient all-reduced over tp by DTensor.
            block_plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            block_plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return block_plan


def _op_sac_policy():
    # Save the outputs of matmuls and attention (expensive to recompute), recompute the rest.
    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def apply_ac(model: Transformer, mode: str, selective_option: str = "op") -> None:
    """'full': recompute every block; 'selective' + 'op': keep matmul/attention outputs;
    'selective' + N: recompute every Nth block fully."""
    every_nth = int(selective_option) if mode == "selective" and selective_option != "op" else 0
    for layer_id, block in model.layers.named_children():
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif every_nth:
            if (int(layer_id) + 1) % every_nth:
                continue
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, context_fn=_op_sac_policy(), preserve_rng_state=False)
        model.layers.register_module(layer_id, wrapped)


def apply_compile(model: Transformer, backend: str = "inductor") -> None:
    """Compile each block separately: blocks share code, so one compiled graph serves all."""
    for block in model.layers.values():
        # nn.Module.compile keeps parameter names (no `_orig_mod.` prefix in state dicts).
        block.compile(backend=backend, fullgraph=True)


def apply_fsdp(
    model: Transformer,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: str = "default",
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2: one unit per block, the root holds embeddings, final norm and output; with
    `expert_mesh` (expert parallelism) each block's ep-sharded experts are a unit of their own
    over that mesh, the ranks that hold the same experts.

    Gradients are summed, not averaged, over dp ranks: the loss must be normalised by the global
    token count (see `titanrl.components.loss`), which keeps results identical to one rank
    whatever the token split between ranks.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = model.blocks()
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # The last block's params are needed again right away in backward.
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        if expert_mesh is not None and block.moe is not None:
            fully_shard(
                block.moe.experts,
                mesh=expert_mesh,
                mp_policy=mp_policy,
                reshard_after_forward=reshard,
                shard_placement_fn=partial(_expert_placement, fsdp_size=expert_mesh.size()),
            )
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward == "always")
    # The trainer's logprobs come from `model.logprobs`, not `forward`: FSDP must gather for it too.
    register_fsdp_forward_method(model, "logprobs")
    for module in model.modules():
        if isinstance(module, FSDPModule):  # the setting is per FSDP unit
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (no PREMUL_SUM with a factor of 1): also the only reduction gloo implements.
            module.set_force_sum_reduction_for_comms(True)


def _expert_placement(param: nn.Parameter, fsdp_size: int) -> Shard:
    """FSDP2 shards this rank's experts on the expert dim when there are enough of them, else
    on the hidden dim (TorchTitan's rule): no padded, empty shards."""
    assert isinstance(param, DTensor), "the experts are ep-sharded DTensors"
    return Shard(0) if param.to_local().shape[0] % fsdp_size == 0 else Shard(1)


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip by the norm over all gradients, which may be DTensors on different meshes/placements.

    `torch.nn.utils.clip_grad_norm_` cannot stack norms of DTensors that live on different meshes
    (FSDP+TP, replicated norms), so norms are computed per (mesh, placements) group, made full,
    and combined. Returns the total norm (before clipping); max_norm <= 0 only measures it.
    """
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if max_norm > 0:
        # Per group as well: one foreach op cannot mix DTensors of several meshes (experts on
        # the ep mesh, the rest on dp_shard).
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total

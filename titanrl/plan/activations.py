"""The update step's transient memory on one rank: an analytic model of the activations a
backward keeps, and FSDP2's unsharded parameters and gradients in flight.

The tensors saved per token of one block (compute dtype, `b` bytes each element), read off the
block's autograd graph (`models/model.py`):
  - attention: the two norms' inputs (D, sequence-sharded over tp) and outputs (D, gathered),
    q / k / v ((Hq + 2 Hkv) hd / tp; qk-norm keeps its inputs too), the attention output
    (Hq hd / tp) and the output projection's result (D);
  - dense MLP: w1 and w3 outputs, the SiLU and the product (4 F / tp), w2's result (D);
  - MoE (not tensor-parallel): per routed copy (top_k a token, balanced over ep ranks) the
    dispatched row (D), w1 / w3 / SiLU / product (4 Fe) and the combined row (D); the router's
    logits and probabilities (2 E); shared experts as a dense MLP.
Activation checkpointing keeps per block only its input ('full'), the matmul and attention
outputs ('selective' + 'op'), or every Nth block's input ('selective' + N), plus one block
recomputed in backward. The logprob head keeps `logprob_chunk_tokens` x vocab / tp float32 logits
and their log-softmax. Tokens are one micro-batch of the update: rows of prompt + completion
tokens as `Workload` states, split over dp and cp ranks and by `micro_batch_tokens`.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from titanrl.config.job_config import JobConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.models.args import TransformerModelArgs
from titanrl.models.model import Transformer

FSDP_DIMS = ("dp_replicate", "dp_shard", "dp_shard_cp", "dp_shard_mod_ep")
"""Mesh dims that FSDP2 shards over (the others are tp / ep, whose shards stay whole)."""


@dataclass
class Workload:
    """What one RL step trains on, per the config and the planner's assumptions."""

    prompt_tokens: int
    """Prompt length of every sample (the config states only the completion's budget)."""

    completion_tokens: int
    """Completion length: generator.max_new_tokens (every sample as long as it may be)."""

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def update_tokens(config: JobConfig, dims: ParallelDims, workload: Workload, max_seq_len: int) -> int:
    """Tokens of one micro-batch of the update on one rank (after the cp split)."""
    seq = min(workload.seq_tokens, max_seq_len)
    group = config.algorithm.group_size if config.job.recipe == "rl" else 1
    rows = math.ceil(config.training.batch_size * group / dims.dp_size / config.algorithm.num_minibatches)
    tokens = rows * seq
    if config.training.micro_batch_tokens > 0:
        tokens = min(tokens, max(config.training.micro_batch_tokens, seq))
    return math.ceil(tokens / dims.cp)


def _attention_elems(args: TransformerModelArgs, tp: int) -> tuple[int, int]:
    """(elements a token keeps in attention, of them matmul / attention outputs) per block."""
    if args.kv_lora_rank:  # MLA: latent projections replicated, heads split over tp
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        heads = args.n_heads // tp
        kept = args.q_lora_rank + args.kv_lora_rank + heads * (2 * qk + 2 * args.v_head_dim)
        return kept, kept
    hd, hq, hkv = args.head_dim, args.n_heads // tp, args.n_kv_heads // tp
    proj = (hq + 2 * hkv) * hd
    kept = proj + 2 * hq * hd + ((hq + hkv) * hd if args.qk_norm else 0)
    return kept, proj + hq * hd


def _ffn_elems(args: TransformerModelArgs, moe: bool, tp: int) -> tuple[int, int]:
    """(elements a token keeps in its feed-forward, of them matmul outputs) per block."""
    if not moe:
        return 4 * args.hidden_dim // tp, 2 * args.hidden_dim // tp
    fe, k, e = args.moe_intermediate_size, args.moe_top_k, args.moe_num_experts
    shared = 4 * fe * args.moe_shared_experts
    return k * (2 * args.dim + 4 * fe) + 2 * e + shared, k * 2 * fe + e + shared // 2


def block_elems(args: TransformerModelArgs, moe: bool, tp: int) -> tuple[int, int]:
    """(elements one token keeps in a block without checkpointing, with selective 'op')."""
    attn, attn_mm = _attention_elems(args, tp)
    ffn, ffn_mm = _ffn_elems(args, moe, tp)
    norms = 2 * args.dim // tp + 2 * args.dim  # inputs sequence-sharded, outputs gathered
    return norms + attn + ffn + 2 * args.dim, attn_mm + ffn_mm + 2 * args.dim


def activation_bytes(config: JobConfig, model: Transformer, dims: ParallelDims, tokens: int) -> int:
    """The activations a micro-batch of `tokens` keeps at the start of the backward, plus the
    block being recomputed and the logprob head's chunk (module docstring)."""
    args, ac = model.args, config.activation_checkpoint
    b = torch.empty(0, dtype=getattr(torch, config.training.mixed_precision_param)).element_size()
    per_block = [block_elems(args, block.moe_enabled, dims.tp) for block in model.blocks()]
    boundary = args.dim // dims.tp  # the residual stream, sequence-sharded over tp
    if ac.mode == "full":
        kept = len(per_block) * boundary + max(full for full, _ in per_block)
    elif ac.mode == "selective" and ac.selective_ac_option == "op":
        kept = sum(op for _, op in per_block) + max(full for full, _ in per_block)
    elif ac.mode == "selective":
        every = int(ac.selective_ac_option)
        kept = sum(boundary if (i + 1) % every == 0 else full for i, (full, _) in enumerate(per_block))
        kept += max(full for full, _ in per_block)
    else:
        kept = sum(full for full, _ in per_block)
    head = 2 * 4 * config.training.logprob_chunk_tokens * args.vocab_size // dims.tp
    return tokens * (kept * b + 2 * args.dim * b) + head


def recompute_kept_bytes(config: JobConfig, model: Transformer, dims: ParallelDims, tokens: int) -> int:
    """Under activation checkpointing, each recomputed MoE block's `aux_loss` (set again by the
    recompute, `models/moe.py`) holds the recomputed graph before its experts (norms, attention,
    router) until the next forward: through the rest of the backward and the optimizer step."""
    if config.activation_checkpoint.mode == "none":
        return 0
    args, ac = model.args, config.activation_checkpoint
    b = torch.empty(0, dtype=getattr(torch, config.training.mixed_precision_param)).element_size()
    every = int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option != "op" else 1
    attn, _ = _attention_elems(args, dims.tp)
    kept = 2 * args.dim // dims.tp + 2 * args.dim + attn + 2 * args.dim + 2 * args.moe_num_experts
    blocks = [i for i, block in enumerate(model.blocks()) if block.moe_enabled and (i + 1) % every == 0]
    return len(blocks) * tokens * kept * b


def _fsdp_unsharded_numel(p: nn.Parameter) -> int:
    """Elements of `p` on this rank once FSDP2 all-gathers it (its tp / ep shard)."""
    if not isinstance(p, DTensor):
        return p.numel()
    names = p.device_mesh.mesh_dim_names or ()
    split = 1
    for name, placement in zip(names, p.placements):
        if isinstance(placement, Shard) and name not in FSDP_DIMS:
            split *= p.device_mesh.size(names.index(name))
    return p.numel() // split


def fsdp_transient_bytes(config: JobConfig, model: Transformer, dims: ParallelDims) -> int:
    """FSDP2's unsharded tensors at the turn from forward to backward: the last block stays
    gathered (`apply_fsdp` does not reshard it), the next one is prefetched, one block's unsharded
    gradients wait for their reduce-scatter, and the root's embeddings / head stay gathered."""
    if not any(
        isinstance(p, DTensor) and set(p.device_mesh.mesh_dim_names or ()) & set(FSDP_DIMS) for p in model.parameters()
    ):
        return 0
    t = config.training
    compute = torch.empty(0, dtype=getattr(torch, t.mixed_precision_param)).element_size()
    reduce = torch.empty(0, dtype=getattr(torch, t.mixed_precision_reduce)).element_size()
    block = max(sum(_fsdp_unsharded_numel(p) for p in blk.parameters()) for blk in model.blocks())
    root_params = {id(p) for blk in model.blocks() for p in blk.parameters()}
    root = sum(_fsdp_unsharded_numel(p) for p in model.parameters() if id(p) not in root_params)
    return block * (2 * compute + reduce) + root * compute

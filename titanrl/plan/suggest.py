"""`titanrl plan --suggest`: the meshes of a world size that fit, fastest first by a roofline
model of one RL step (generation, the update, the weight sync).

The model, whose assumptions `ASSUMPTIONS` prints with the list:
  - update: 6 x active parameters x tokens FLOPs (8 x with full activation checkpointing, the
    forward again), plus causal attention (6 x layers x heads x head_dim x seq per token), at the
    device's dense bf16 peak; FSDP2 all-gathers the weights twice and reduce-scatters the
    gradients once (3 x the bf16 weights a dp group holds); TP moves a block's activations 4
    times forward and 4 backward; EP moves every routed token copy twice forward, twice backward;
    CP all-gathers K / V; each collective at the link its group spans (NVLink within a node of
    `GPUS_PER_NODE`, the network across) and (n - 1) / n of its bytes;
  - generation: every decode step reads the rank's generator weights and the batch's K / V from
    HBM (memory-bound; at least the step's FLOPs at peak), batches of max_num_seqs (or what the
    KV pool holds) of each dp rank's samples, every sample `Workload.completion_tokens` long;
  - weight sync: the generator's bf16 copy gathered over the dp group once a step.
Ideal hardware, no overlap: the absolute seconds are optimistic, the order is the point.
"""

import math
from dataclasses import dataclass, replace

import torch

from titanrl.config.job_config import JobConfig
from titanrl.models.args import TransformerModelArgs
from titanrl.models.model import Transformer
from titanrl.plan.activations import Workload
from titanrl.plan.memory import GIB, JobPlan, RankPlan, on_device, plan_job, plan_model_args

GPUS_PER_NODE = 8


@dataclass
class Hardware:
    flops: float
    """Dense bf16 FLOP/s."""

    hbm: float
    """HBM bytes/s."""

    nvlink: float
    """Bytes/s a device sends to the others of its node."""

    network: float
    """Bytes/s a device sends across nodes (one 400 Gb/s NIC per GPU)."""


HARDWARE = {
    "h100-80gb": Hardware(989e12, 3.35e12, 450e9, 50e9),
    "h200-141gb": Hardware(989e12, 4.8e12, 450e9, 50e9),
    "b200-192gb": Hardware(2250e12, 8e12, 900e9, 50e9),
}
"""Datasheet peaks; a device given in GiB is timed as an H100."""

ASSUMPTIONS = (
    "step-time model (titanrl/plan/suggest.py): ideal roofline, no overlap; update 6 (8 with full AC) x active "
    "params x tokens + causal attention at peak bf16; FSDP 3 x weights, TP 8 x activations per block, EP 4 x routed "
    "tokens, CP K/V all-gathers at NVLink within 8-GPU nodes, 50 GB/s per GPU across; generation memory-bound "
    "(weights + K/V read per decode step); weight sync one gather of the bf16 copy"
)


def _count(args: TransformerModelArgs) -> tuple[int, int]:
    """(parameters, active parameters a token uses) of the unsharded model."""
    with torch.device("meta"):
        model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for b in model.blocks() if b.moe is not None for p in b.moe.experts.parameters())
    idle = experts * (1 - args.moe_top_k / args.moe_num_experts) if args.moe_num_experts else 0
    return total, int(total - idle)


def _link(hw: Hardware, span: int) -> float:
    """Bytes/s of a collective over `span` consecutive ranks (within a node while it fits)."""
    return hw.nvlink if span <= GPUS_PER_NODE else hw.network


def _collective(bytes_: float, n: int, bandwidth: float) -> float:
    return bytes_ * (n - 1) / n / bandwidth if n > 1 else 0.0


def update_seconds(config: JobConfig, args: TransformerModelArgs, d: dict[str, int], hw: Hardware, seq: int) -> float:
    """The update's roofline seconds on one rank (module docstring)."""
    world = math.prod(d[k] for k in ("dp_replicate", "dp_shard", "cp", "tp"))
    total, active = _count(args)
    tokens = config.training.batch_size * config.algorithm.group_size * seq / world  # per rank
    passes = 8 if config.activation_checkpoint.mode == "full" else 6
    attention = 6 * args.n_layers * args.n_heads * args.head_dim * seq
    compute = (passes * active + attention) * tokens * config.algorithm.ppo_epochs / hw.flops
    dp = d["dp_replicate"] * d["dp_shard"] * d["cp"]
    fsdp = _collective(3 * 2 * total / (d["tp"] * d["ep"]), dp, _link(hw, dp * d["tp"]))
    row_tokens = tokens * d["tp"] * d["cp"]  # the tp and cp ranks of a sequence share its tokens
    tp = _collective(8 * args.n_layers * row_tokens * args.dim * 2, d["tp"], hw.nvlink)
    moe_layers = sum(map(args.is_moe_layer, range(args.n_layers)))
    ep = _collective(4 * moe_layers * tokens * args.moe_top_k * args.dim * 2, d["ep"], _link(hw, d["ep"] * d["tp"]))
    kv = 2 * args.n_kv_heads * args.head_dim * 2
    cp = _collective(3 * args.n_layers * row_tokens * kv, d["cp"], _link(hw, d["cp"] * d["tp"]))
    return compute + fsdp + tp + ep + cp


def generation_seconds(config: JobConfig, rank: RankPlan, d: dict[str, int], hw: Hardware, seq: int) -> float:
    """Decode steps x the larger of their bytes at HBM speed and their FLOPs at peak."""
    g = config.generator
    dp = d["dp_replicate"] * d["dp_shard"] * d["cp"]
    samples = math.ceil(config.training.batch_size * config.algorithm.group_size / dp)
    batch = max(1, min(g.max_num_seqs, samples, rank.kv.tokens // seq))
    weights = rank.generator_weights if rank.generator_weights is not None else rank.policy.params
    kv_per_token = rank.kv.bytes / max(rank.kv.tokens, 1)
    step = (weights + batch * seq / 2 * kv_per_token) / hw.hbm
    return math.ceil(samples / batch) * g.max_new_tokens * step


@dataclass
class Suggestion:
    degrees: dict[str, int]
    seconds: float
    plan: JobPlan


def candidate_meshes(config: JobConfig, args: TransformerModelArgs, world: int) -> list[dict[str, int]]:
    """dp_shard x tp x ep x cp (dp_replicate 1: HSDP only changes the collectives' span)."""
    meshes = []
    for tp in (t for t in (1, 2, 4, 8) if world % t == 0):
        for cp in (1, 2) if not (args.moe_num_experts or args.kv_lora_rank) else (1,):
            dp_shard = world // (tp * cp)
            if dp_shard * tp * cp != world:
                continue
            experts = args.moe_num_experts
            for ep in [
                e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if experts and experts % e == 0 and dp_shard % e == 0
            ] or [1]:
                meshes.append({"dp_replicate": 1, "dp_shard": dp_shard, "tp": tp, "ep": ep, "cp": cp})
    return meshes


def mesh_plans(config: JobConfig, world: int, device: int, workload: Workload) -> list[tuple[JobConfig, JobPlan]]:
    """Rank 0's plan of every candidate mesh that builds, with the config that has that mesh."""
    args = plan_model_args(config)
    found = []
    for d in candidate_meshes(config, args, world):
        mesh = replace(config.parallelism, dp_replicate=d["dp_replicate"], dp_shard=d["dp_shard"], tp=d["tp"])
        trial = replace(config, parallelism=replace(mesh, ep=d["ep"], cp=d["cp"]))
        try:
            found.append((trial, plan_job(trial, world, device, workload, ranks=(0,))))
        except ValueError:
            continue  # a mesh the model or the parallel plan cannot take
    return found


def rank_plans(plans: list[tuple[JobConfig, JobPlan]], device: int, gpu: str, workload: Workload) -> list[Suggestion]:
    """The plans that fit on devices of `device` bytes, fastest first (module docstring)."""
    hw = HARDWARE.get(gpu, HARDWARE["h100-80gb"])
    found = []
    for trial, built in plans:
        plan = on_device(built, trial, device)
        if not plan.fits():
            continue
        args, d = plan_model_args(trial), plan.degrees
        seq = min(workload.seq_tokens, args.max_seq_len)
        seconds = update_seconds(trial, args, d, hw, seq) + generation_seconds(trial, plan.ranks[0], d, hw, seq)
        weights = plan.ranks[0].generator_weights or 0
        seconds += _collective(weights * d["dp_shard"], d["dp_shard"], _link(hw, plan.world))
        found.append(Suggestion(d, seconds, plan))
    return sorted(found, key=lambda s: s.seconds)


def suggest(config: JobConfig, world: int, device: int, gpu: str, workload: Workload) -> list[Suggestion]:
    """The candidate meshes that build and fit, fastest first."""
    return rank_plans(mesh_plans(config, world, device, workload), device, gpu, workload)


def format_suggestions(config: JobConfig, world: int, device: int, gpu: str, workload: Workload) -> str:
    found = suggest(config, world, device, gpu, workload)
    lines = [f"meshes that fit on {world} x {gpu}, fastest first:", ASSUMPTIONS]
    if not found:
        lines.append("none fits: add ranks, turn on activation checkpointing or lower the batch")
    for s in found:
        mesh = " ".join(f"{k}={v}" for k, v in s.degrees.items())
        r = s.plan.ranks[0]
        lines.append(
            f"  {mesh:<55} step ~{s.seconds:8.1f} s  peak {r.peak() / GIB:6.1f} GiB  KV {r.kv.tokens:,} tokens"
        )
    return "\n".join(lines)

"""A job's memory plan: for each rank class of its mesh, every component's bytes, the two phases
of an RL step that compete for the device (generation with the KV pool; the update with
gradients and activations), and whether the larger fits.

Rank classes: FSDP2, TP and EP shard with `torch.chunk`'s rule, so the first rank of every mesh
dim holds the largest shard of every parameter and the last the smallest; rank 0 bounds every
rank from above and rank N - 1 from below, and the plan is made for both (one where they
coincide). Where every degree divides every sharded dim, all ranks are alike.
"""

import dataclasses
import os
from dataclasses import dataclass

from titanrl.components.launch import model_args as config_model_args
from titanrl.config.job_config import JobConfig
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.plan.activations import (
    Workload,
    activation_bytes,
    fsdp_transient_bytes,
    recompute_kept_bytes,
    update_tokens,
)
from titanrl.plan.ranks import (
    KVPool,
    ModelBytes,
    buffer_bytes,
    build_rank_models,
    fake_world,
    kv_pool,
    mesh_dims,
    model_bytes,
    param_bytes,
    step_temp_bytes,
)

GIB = 1 << 30

GPUS = {"h100-80gb": 81559 << 20, "h200-141gb": 143771 << 20, "b200-192gb": 183359 << 20}
"""Device memory as nvidia-smi reports it (MiB): what `--gpu` names."""

RESERVED_BYTES = 3 * GIB
"""Taken off every device before the plan: CUDA context, NCCL buffers, the allocator's slack."""


def device_bytes(gpu: str) -> int:
    """`--gpu`: a name in GPUS, or a number of GiB."""
    if gpu in GPUS:
        return GPUS[gpu]
    try:
        return int(float(gpu) * GIB)
    except ValueError:
        raise ValueError(f"--gpu '{gpu}' is neither {', '.join(GPUS)} nor a number of GiB") from None


@dataclass
class RankPlan:
    """One rank class's bytes, by component."""

    rank: int
    policy: ModelBytes
    reference: ModelBytes | None
    critic: ModelBytes | None
    reward_model: ModelBytes | None
    generator_weights: int | None
    """The generator's own copy of the weights; None where it shares the policy's."""

    kv: KVPool
    activations: int
    """The update step's activations (`plan/activations.py`)."""

    fsdp_buffers: int
    """FSDP2's gathered parameters and unsharded gradients in flight during the update."""

    recompute_kept: int
    """Recomputed MoE activations the backward leaves alive (`activations.recompute_kept_bytes`)."""

    step_temp: int
    """The optimizer step's temporaries (`ranks.step_temp_bytes`)."""

    update_tokens: int

    def resident(self) -> int:
        """Bytes held through the whole step: every model's weights and optimizer state."""
        models = (self.reference, self.critic, self.reward_model)
        held = self.policy.params + self.policy.optimizer + self.policy.buffers + (self.generator_weights or 0)
        return held + sum(m.params + m.optimizer + m.buffers for m in models if m is not None)

    def generation_peak(self) -> int:
        return self.resident() + self.kv.bytes

    def update_peak(self) -> int:
        """The update step's peak: what stays, and the larger of the activations with FSDP2's
        buffers (the end of the forward, no gradient yet: `zero_grad` sets them to None) and the
        gradients (the end of the backward, activations freed) with those buffers or the
        optimizer step's temporaries."""
        grads = self.policy.grads + (self.critic.grads if self.critic is not None else 0)
        late = grads + self.recompute_kept + max(self.fsdp_buffers, self.step_temp)
        transient = max(self.activations + self.fsdp_buffers, late)
        return self.resident() + transient

    def peak(self) -> int:
        return max(self.generation_peak(), self.update_peak())


def on_device(plan: "JobPlan", config: JobConfig, device: int) -> "JobPlan":
    """`plan` on devices of `device` bytes: only the KV pool sized from free memory changes."""
    args = plan_model_args(config)
    tp = plan.degrees["tp"]
    ranks = []
    for r in plan.ranks:
        free = device - RESERVED_BYTES - r.policy.params - r.policy.buffers - (r.generator_weights or 0)
        ranks.append(dataclasses.replace(r, kv=kv_pool(config, args, tp, free)))
    return JobPlan(plan.world, device, plan.degrees, ranks)


def plan_model_args(config: JobConfig) -> TransformerModelArgs:
    """The policy's shape: the checkpoint's config.json when the folder is here, else model.flavor
    (a plan is often made before the weights are downloaded)."""
    hf = config.model.hf_checkpoint
    if hf and os.path.isfile(os.path.join(hf, "config.json")):
        return config_model_args(config, 0)
    args = get_model_args(config.model.flavor)
    if config.model.max_seq_len:
        args.max_seq_len = config.model.max_seq_len
    return args


def plan_rank(
    config: JobConfig, args: TransformerModelArgs, world: int, rank: int, device: int, workload: Workload
) -> RankPlan:
    """Rank `rank`'s plan, its models built under a fake process group of `world` ranks."""
    with fake_world(world, rank):
        dims = mesh_dims(config, world)
        try:
            models = build_rank_models(config, args, dims)
        except NotImplementedError as e:  # FSDP2's own limits, e.g. uneven shards of a dim > 0
            raise ValueError(f"FSDP2 cannot shard this mesh: {e}; change dp_shard, ep or tp") from None
        policy = model_bytes(models.policy, config.optimizer.name)
        gen = None if models.generator is None else param_bytes(models.generator) + buffer_bytes(models.generator)
        # The generator sizes its pool when built: after the policy and its own weights, before the rest.
        kv = kv_pool(config, args, dims.tp, device - RESERVED_BYTES - policy.params - policy.buffers - (gen or 0))
        tokens = update_tokens(config, dims, workload, args.max_seq_len)
        return RankPlan(
            rank=rank,
            policy=policy,
            reference=None if models.reference is None else model_bytes(models.reference, None),
            critic=None if models.critic is None else model_bytes(models.critic, config.optimizer.name),
            reward_model=None if models.reward_model is None else model_bytes(models.reward_model, None),
            generator_weights=gen,
            kv=kv,
            activations=activation_bytes(config, models.policy, dims, tokens),
            fsdp_buffers=fsdp_transient_bytes(config, models.policy, dims),
            recompute_kept=recompute_kept_bytes(config, models.policy, dims, tokens),
            step_temp=step_temp_bytes(models.policy, config.optimizer),
            update_tokens=tokens,
        )


@dataclass
class JobPlan:
    world: int
    device_bytes: int
    degrees: dict[str, int]
    ranks: list[RankPlan]

    @property
    def usable_bytes(self) -> int:
        return self.device_bytes - RESERVED_BYTES

    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak())

    def fits(self) -> bool:
        return self.worst().peak() <= self.usable_bytes


def plan_job(
    config: JobConfig, world: int, device: int, workload: Workload, ranks: tuple[int, ...] | None = None
) -> JobPlan:
    """The plan of `ranks`, by default rank 0 and rank `world` - 1 (module docstring); ValueError
    with the fix where the mesh or the parallel plan cannot be built."""
    args = plan_model_args(config)
    check_degrees(config, args, world)
    chosen = sorted({0, world - 1} if ranks is None else set(ranks))
    plans = [plan_rank(config, args, world, r, device, workload) for r in chosen]
    dims = ranks_degrees(config, world)
    return JobPlan(world, device, dims, plans)


def ranks_degrees(config: JobConfig, world: int) -> dict[str, int]:
    p = config.parallelism
    dp_shard = p.dp_shard if p.dp_shard != -1 else world // (p.dp_replicate * p.cp * p.tp)
    return {"dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "tp": p.tp, "ep": p.ep, "cp": p.cp}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_degrees(config: JobConfig, args: TransformerModelArgs, world: int) -> None:
    """The constraints a mesh must meet, each with its fix, before anything is built; the real
    `ParallelDims` and `parallelize_model` then check the rest with their own messages."""
    p = config.parallelism
    if p.tp > 1:
        sizes = {"num_heads": args.n_heads, "num_kv_heads": args.n_kv_heads}
        sizes |= {"hidden_dim": args.hidden_dim, "vocab_size": args.vocab_size}  # `apply_tp`'s rule
        for name, size in sizes.items():
            if size % p.tp:
                ok = [d for d in _divisors(world) if all(s % d == 0 for s in sizes.values())]
                raise ValueError(f"{name} {size} not divisible by tp {p.tp}: use tp in {ok}")
    if p.ep > 1:
        if not args.moe_num_experts:
            raise ValueError(f"ep {p.ep} on a dense model (no experts): use ep = 1")
        if args.moe_num_experts % p.ep:
            ok = [d for d in _divisors(args.moe_num_experts) if world % d == 0]
            raise ValueError(f"num_experts {args.moe_num_experts} not divisible by ep {p.ep}: use ep in {ok}")

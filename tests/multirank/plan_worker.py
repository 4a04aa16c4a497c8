"""Measure what `titanrl plan` predicts: every rank builds the real models of each case
(`CASES`), runs one update (forward, backward, optimizer step) on a micro-batch of the planned
size, and prints its measured parameter, gradient and optimizer bytes and the step's peak.

Launched by tests/test_plan.py on 1, 2 and 4 gloo ranks (one launch per world size, every case
in it, in the background: helpers/background.py); `case_config` is also the test's, so plan and measurement read one config.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from titanrl.components.model_builder import build_model
from titanrl.components.optimizer import build_optimizer
from titanrl.config.job_config import JobConfig
from titanrl.data.batch_forward import forward_logprobs
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.models.flavors import get_model_args

CASES = {
    # name: (flavor, {section: {key: value}}) at each world size (ep = 2 needs 2 ranks or more)
    "dense": ("debug", {"parallelism": {"dp_shard": -1}}),
    "dense_tp": ("debug", {"parallelism": {"tp": 2}, "training": {"mixed_precision_param": "bfloat16"}}),
    "moe_ep": ("debug-moe", {"parallelism": {"ep": 2}}),
    "moe_ac": ("debug-moe", {"activation_checkpoint": {"mode": "full"}}),
    "dense_cp": ("debug", {"parallelism": {"cp": 2}}),
}
"""The layouts measured: plain FSDP2, TP (with bf16 compute), EP, a checkpointed MoE, CP."""

ROWS, SEQ = 8, 64
"""The micro-batch each rank trains: ROWS sequences of SEQ tokens (the plan's Workload)."""


def case_config(name: str) -> JobConfig:
    flavor, sections = CASES[name]
    config = JobConfig()
    config.model.flavor = flavor
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    config.generator.num_blocks = 64
    config.training.logprob_chunk_tokens = 64
    config.training.micro_batch_tokens = ROWS * SEQ
    return config


def cases_for(world: int) -> list[str]:
    return [n for n in CASES if world >= max(CASES[n][1].get("parallelism", {}).get(k, 1) for k in ("tp", "ep", "cp"))]


def _storages(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a view into a shared buffer counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def update(model, optimizer, tokens_BT: torch.Tensor, config: JobConfig) -> int:
    """One forward, backward and optimizer step; the gradients' bytes before the step."""
    mask_BT, length_B = torch.ones_like(tokens_BT[:, 1:]), torch.full((ROWS,), SEQ + 1)
    batch = TensorDict({"tokens": tokens_BT, "loss_mask": mask_BT, "length": length_B}, batch_size=[ROWS])
    logprobs_BT, _ = forward_logprobs(model, batch, False, config.training.logprob_chunk_tokens)
    logprobs_BT.mean().backward()
    grads = _storages(q.grad for q in model.parameters() if q.grad is not None)
    optimizer.step()
    return grads


def measure(name: str, world: int) -> dict:
    """One update of case `name` on this rank: its measured bytes and peak."""
    config = case_config(name)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world, p.ep, p.cp)
    args = get_model_args(config.model.flavor)
    model = build_model(args, dims, config, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optimizer)
    params = _storages(model.parameters())
    g = torch.Generator().manual_seed(dims.dp_rank)
    tokens_BT = torch.randint(0, args.vocab_size, (ROWS, SEQ + 1), generator=g)
    update(model, optimizer, tokens_BT, config)  # the optimizer state exists from the first step on
    optimizer.zero_grad()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        grads = update(model, optimizer, tokens_BT, config)
    states = _storages(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return {"case": name, "params": params, "grads": grads, "optimizer": states, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    out = parser.parse_args().out
    rank, world = init_distributed()
    torch.manual_seed(0)
    results = [measure(name, world) for name in cases_for(world)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The generator with experts sharded over 2 ep ranks against an unsharded one on each rank.

Launched by tests/test_moe_parallel.py with torchrun (2 gloo ranks). Each rank builds the trainer's
model as a job does (FSDP2 + ep = 2, `build_model`) and an ep-sharded generator synced from it,
and an unsharded 1-rank generator loaded with the same full state dict. The ranks get different
prompts, of different lengths and counts, and different max_new_tokens, so that their schedules
differ (one finishes first and serves the other's all-to-alls). Every rank saves its greedy
tokens and recorded routes from both generators, and how many idle forwards it ran.
"""

import argparse

import torch
import torch.distributed as dist
from moe_parity_worker import MOE_ARGS

from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.generator import Generator, SamplingParams
from titanrl.models.model import Transformer


def rank_prompts(rank: int) -> tuple[list[list[int]], int]:
    """Rank 0: 3 prompts, 4 new tokens; rank 1: 5 longer prompts, 10 new tokens."""
    g = torch.Generator().manual_seed(10 + rank)
    count, new_tokens = (3, 4) if rank == 0 else (5, 10)
    lengths = torch.randint(2, 7 + 6 * rank, (count,), generator=g).tolist()
    return [torch.randint(1, MOE_ARGS.vocab_size, (n,), generator=g).tolist() for n in lengths], new_tokens


def generate(gen: Generator, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, n=2)
    completions, _ = gen.generate(prompts, params)
    return [{"tokens": c.token_ids, "routes": c.routes} for c in completions]


def refused(gen: Generator, prompts: list[list[int]], new_tokens: int) -> str:
    try:
        generate(gen, prompts, new_tokens)
    except ValueError as e:
        return str(e)
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    dims = ParallelDims(1, world_size, 1, world_size, ep=world_size)
    full_state = init_full_state_dict(MOE_ARGS, seed=0)
    reference = Transformer(MOE_ARGS)
    reference.load_state_dict(full_state)
    state = init_full_state_dict(MOE_ARGS, seed=0)  # build_model makes its tensors DTensors
    trainer = build_model(MOE_ARGS, dims, JobConfig(), torch.device("cpu"), full_state_dict=state)
    # Small blocks and few of them: prefix sharing, copy-on-write and preemption all happen.
    config = GeneratorConfig(block_size=4, num_blocks=24)
    sharded = Generator(MOE_ARGS, config, torch.device("cpu"), ep_mesh=dims.world_mesh["ep"])
    sharded.load_weights(trainer)
    whole = Generator(MOE_ARGS, config, torch.device("cpu"))
    whole.load_weights(reference)
    prompts, new_tokens = rank_prompts(rank)
    local_experts = sharded.model.layers["0"].moe.experts.local_weights()[0].shape[0]
    out = {
        "sharded": generate(sharded, prompts, new_tokens),
        "whole": generate(whole, prompts, new_tokens),
        # Rank 0 without prompts (as a rank with no held-out samples): it serves rank 1's forwards.
        "one_sided": generate(sharded, prompts[:1] if rank else [], new_tokens),
        # Rank 1's call is refused (an empty prompt): both ranks raise, neither waits forever.
        "refused": refused(sharded, [[]] if rank else prompts, new_tokens),
        "after_refusal": generate(sharded, prompts, new_tokens),
        "idle_forwards": sharded.lockstep.idle_forwards,
        "local_experts": local_experts,
    }
    torch.save(out, f"{cli.out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

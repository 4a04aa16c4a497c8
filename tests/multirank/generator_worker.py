"""Trainer (FSDP2 / TP / both) -> generator weight sync and paged generation on several ranks.

For each layout, every rank checks its greedy completions against a full-recompute reference
model built from the trainer's current full weights, before and after an optimizer step; rank 0
writes one JSON summary.
"""

import argparse
import json

import torch
import torch.distributed as dist

from tests.helpers.reference import greedy_reference
from tests.helpers.tiny import tiny_model_args
from titanrl.components.loss import global_token_count, sft_loss
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer
from titanrl.models.logprobs import token_logprobs

ARGS = tiny_model_args(hidden_dim=128, vocab_size=128, max_seq_len=64)
LAYOUTS = {"fsdp2": (1, 2, 1), "tp2": (1, 1, 2), "fsdp2_tp2": (1, 2, 2), "tp2_chunked": (1, 1, 2)}
# Layouts whose prompts (3, 9 and 14 tokens) are prefilled in chunks of this many tokens.
PREFILL_CHUNK = {"tp2_chunked": 4}


def full_reference_model(trainer: torch.nn.Module) -> Transformer:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(trainer, options=StateDictOptions(full_state_dict=True))
    model = Transformer(ARGS)
    model.init_weights()
    model.load_state_dict(sd)
    return model.eval()


def check(gen: Generator, trainer, prompts) -> dict:
    ref_model = full_reference_model(trainer)
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, n=2))
    mismatches, max_lp_diff = 0, 0.0
    for c in completions:
        ids, lps = greedy_reference(ref_model, prompts[c.prompt_index], 12)
        mismatches += c.token_ids != ids
        max_lp_diff = max(max_lp_diff, max(abs(a - b) for a, b in zip(c.logprobs, lps)))
    return {
        "n": len(completions),
        "mismatches": mismatches,
        "max_lp_diff": max_lp_diff,
        "prefill_tokens": stats.prefill_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_chunks": stats.prefill_chunks,
    }


def run_layout(layout: str, world_size: int) -> dict:
    dims = ParallelDims(*LAYOUTS[layout], world_size=world_size)
    trainer = build_model(ARGS, dims, JobConfig(), torch.device("cpu"), full_state_dict=init_full_state_dict(ARGS, 0))
    tp_mesh = dims.world_mesh["tp"] if dims.tp_enabled else None
    config = GeneratorConfig(block_size=4, num_blocks=64, max_num_batched_tokens=PREFILL_CHUNK.get(layout, 4096))
    gen = Generator(ARGS, config, torch.device("cpu"), tp_mesh=tp_mesh)
    # dp ranks generate different prompts; the ranks of a TP group generate the same ones.
    g = torch.Generator().manual_seed(100 + dims.dp_rank)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 9, 14)]

    gen.load_weights(trainer)
    before = check(gen, trainer, prompts)

    opt = torch.optim.SGD(trainer.parameters(), lr=1.0)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(dims.dp_rank))
    mask = torch.ones(2, 16)
    dp_group = dims.dp_mesh.get_group() if dims.dp_size > 1 else None
    sft_loss(
        token_logprobs(trainer(tokens[:, :-1]), tokens[:, 1:]), mask, global_token_count(mask, dp_group)
    ).backward()
    opt.step()
    gen.load_weights(trainer)
    after = check(gen, trainer, prompts)
    return {"before": before, "after": after, "dp_rank": dims.dp_rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {}
    for layout in cli.layouts.split(","):
        mine = run_layout(layout, world_size)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        results[layout] = gathered
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

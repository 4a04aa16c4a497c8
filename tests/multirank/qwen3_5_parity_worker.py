"""Train a tiny Qwen3.5 hybrid (gated DeltaNet layers + a gated full-attention layer) 2 steps
under tp = 2; rank 0 saves the results.

Launched by tests/test_qwen3_5.py with torchrun (2 gloo ranks); `run_layout` also runs
in-process as the 1-rank reference, from the same init and global batch.
"""

import argparse

import torch
import torch.distributed as dist
from moe_parity_worker import DTYPES, STEPS, full_params_and_grads
from parity_worker import make_batch, train_steps

from tests.helpers.reference import greedy_reference
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer
from titanrl.models.args import TransformerModelArgs

# Key and value heads of different counts and sizes (2 x 8 vs 4 x 12): a q | k | v split that
# mixes them up cannot line up by accident. Layer 1 is full attention (output gate, QK-norm,
# partial rotary), layer 0 linear.
QWEN3_5_ARGS = TransformerModelArgs(
    family="qwen3_5",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=64,
    vocab_size=128,
    max_seq_len=32,
    qk_norm=True,
    layer_types=["linear_attention", "full_attention"],
    attn_output_gate=True,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
)


def generate_check(trainer: torch.nn.Module, params: dict, tp_mesh) -> dict:
    """Greedy completions (2 samples per prompt, prompts prefilled in chunks of 4 tokens) of a
    generator with the same tp as `trainer`, synced from it, against a full-recompute one-rank
    model with the full `params`."""
    config = GeneratorConfig(block_size=4, num_blocks=64, max_num_batched_tokens=4)
    gen = Generator(QWEN3_5_ARGS, config, torch.device("cpu"), tp_mesh=tp_mesh)
    gen.load_weights(trainer)
    g = torch.Generator().manual_seed(100)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 9, 14)]
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0, n=2))
    reference = Transformer(QWEN3_5_ARGS)
    reference.load_state_dict(params)
    mismatches, max_lp_diff = 0, 0.0
    for c in completions:
        ids, lps = greedy_reference(reference.eval(), prompts[c.prompt_index], 8)
        mismatches += c.token_ids != ids
        max_lp_diff = max(max_lp_diff, *(abs(a - b) for a, b in zip(c.logprobs, lps, strict=True)))
    return {"n": len(completions), "mismatches": mismatches, "max_lp_diff": max_lp_diff}


def run_layout(tp: int, dtype: str, world_size: int) -> dict:
    """2 AdamW steps on tp ranks (1: the one-rank reference); in float32 on tp ranks, then
    generation by a tp-sharded generator synced from the trained model (`generate_check`)."""
    parallel_dims = ParallelDims(1, 1, tp, world_size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        full_sd = init_full_state_dict(QWEN3_5_ARGS, seed=0)
        model = build_model(QWEN3_5_ARGS, parallel_dims, JobConfig(), torch.device("cpu"), full_state_dict=full_sd)
    finally:
        torch.set_default_dtype(previous)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens_BT, mask_BT = make_batch()
    batch = tokens_BT[:, :-1], tokens_BT[:, 1:], mask_BT.to(DTYPES[dtype])
    losses, grad_norms = train_steps(model, optimizer, batch, None, STEPS)
    placements = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
    result = {"losses": losses, "grad_norms": grad_norms, "placements": placements, **full_params_and_grads(model)}
    if tp > 1 and dtype == "float32":
        result["generated"] = generate_check(model, result["params"], parallel_dims.world_mesh["tp"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {dtype: run_layout(world_size, dtype, world_size) for dtype in DTYPES}
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

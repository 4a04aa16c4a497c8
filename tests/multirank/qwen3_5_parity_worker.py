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

from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
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


def run_layout(tp: int, dtype: str, world_size: int) -> dict:
    """2 AdamW steps on tp ranks (1: the one-rank reference)."""
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
    return {"losses": losses, "grad_norms": grad_norms, "placements": placements, **full_params_and_grads(model)}


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

"""Train a tiny DeepSeek-V3 model (MLA, sigmoid group-limited MoE with a shared expert, one
dense layer) 2 steps under ep = 2 and under tp = 2; rank 0 saves the results.

Launched by tests/test_deepseek_v3.py with torchrun (2 gloo ranks); `run_layout` also runs
in-process as the 1-rank reference, from the same init and global batch.
"""

import argparse

import torch
import torch.distributed as dist
from moe_parity_worker import DTYPES, GLOBAL_BATCH, STEPS, full_params_and_grads
from parity_worker import make_batch, train_steps

from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.models.args import TransformerModelArgs

DSV3_ARGS = TransformerModelArgs(
    family="deepseek_v3",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    hidden_dim=64,
    vocab_size=128,
    max_seq_len=32,
    kv_lora_rank=16,
    q_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    rope_interleave=True,
    moe_num_experts=8,
    moe_top_k=2,
    moe_intermediate_size=16,
    moe_shared_experts=1,
    moe_mlp_only_layers=[0],
    moe_expert_bias=True,
    moe_score_func="sigmoid",
    moe_n_group=4,
    moe_topk_group=2,
    moe_routed_scaling_factor=2.5,
)


# name -> (dp_shard, tp, ep)
LAYOUTS = {"ep2": (2, 1, 2), "tp2": (1, 2, 1)}


def run_layout(layout: str | None, dtype: str, world_size: int) -> dict:
    """2 steps under `layout` (None: the one-rank reference)."""
    dp_shard, tp, ep = LAYOUTS[layout] if layout else (1, 1, 1)
    parallel_dims = ParallelDims(1, dp_shard, tp, world_size, ep)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        full_sd = init_full_state_dict(DSV3_ARGS, seed=0)
        model = build_model(DSV3_ARGS, parallel_dims, JobConfig(), torch.device("cpu"), full_state_dict=full_sd)
    finally:
        torch.set_default_dtype(previous)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_group = parallel_dims.dp_mesh.get_group() if parallel_dims.dp_size > 1 else None
    tokens_BT, mask_BT = make_batch()
    local_B = GLOBAL_BATCH // parallel_dims.dp_size
    rows = slice(parallel_dims.dp_rank * local_B, (parallel_dims.dp_rank + 1) * local_B)
    batch = tokens_BT[rows, :-1], tokens_BT[rows, 1:], mask_BT[rows].to(DTYPES[dtype])
    losses, grad_norms = train_steps(model, optimizer, batch, dp_group, STEPS)
    return {"losses": losses, "grad_norms": grad_norms, **full_params_and_grads(model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {f"{layout}/{dtype}": run_layout(layout, dtype, world_size) for layout in LAYOUTS for dtype in DTYPES}
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

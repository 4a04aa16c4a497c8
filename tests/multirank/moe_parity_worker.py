"""Train a tiny mixture-of-experts model 2 steps under expert-parallel layouts; rank 0 saves the
results.

Launched by tests/test_moe_parallel.py with torchrun (2 or 4 gloo ranks); `run_layout` also runs
in-process as the 1-rank reference. Every layout starts from the same full state dict and sees the
same global batch, split by dp rank (the ep ranks are dp ranks: they see different data).
"""

import argparse

import torch
import torch.distributed as dist
from parity_worker import make_batch, train_steps

from titanrl.components.checkpoint import CheckpointManager
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.models.args import TransformerModelArgs

STEPS = 2
GLOBAL_BATCH = 8

# Layer 0 MoE (8 experts, top-2, one shared expert), layer 1 dense: both kinds under every layout.
MOE_ARGS = TransformerModelArgs(
    family="qwen3_moe",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=64,
    vocab_size=128,
    qk_norm=True,
    tie_word_embeddings=True,
    max_seq_len=32,
    moe_num_experts=8,
    moe_top_k=2,
    moe_intermediate_size=32,
    moe_shared_experts=1,
    moe_mlp_only_layers=[1],
)

# name -> (dp_shard, tp, ep); dp_replicate = 1
LAYOUTS = {
    "ep2": (2, 1, 2),  # 2 ranks: each holds 4 experts
    "ep2_dp4": (4, 1, 2),  # 4 ranks: experts sharded ep = 2, then FSDP2 over dp_shard / ep = 2
    "ep2_tp2": (2, 2, 2),  # 4 ranks: attention and the dense layer tp = 2, experts ep = 2
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run_layout(layout: str | None, dtype: str, world_size: int, ckpt: str = "") -> dict:
    """2 steps under `layout` (None: one rank); with `ckpt`, a checkpoint of the model and its
    optimizer after them (CheckpointManager, DCP) in that folder, as step-2."""
    dp_shard, tp, ep = LAYOUTS[layout] if layout else (1, 1, 1)
    parallel_dims = ParallelDims(1, dp_shard, tp, world_size, ep)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        model = build_model(
            MOE_ARGS,
            parallel_dims,
            JobConfig(),
            torch.device("cpu"),
            full_state_dict=init_full_state_dict(MOE_ARGS, seed=0),
        )
    finally:
        torch.set_default_dtype(previous)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_group = parallel_dims.dp_mesh.get_group() if parallel_dims.dp_size > 1 else None

    tokens_BT, mask_BT = make_batch()
    local_B = GLOBAL_BATCH // parallel_dims.dp_size
    rows = slice(parallel_dims.dp_rank * local_B, (parallel_dims.dp_rank + 1) * local_B)
    inputs_BT, targets_BT, mask_BT = tokens_BT[rows, :-1], tokens_BT[rows, 1:], mask_BT[rows].to(DTYPES[dtype])

    losses, grad_norms = train_steps(model, optimizer, (inputs_BT, targets_BT, mask_BT), dp_group, STEPS)
    if ckpt:
        CheckpointManager(ckpt, keep_latest_k=0).save(STEPS, {"model": model}, {"model": optimizer}, {})
    return {"losses": losses, "grad_norms": grad_norms, **full_params_and_grads(model)}


def full_params_and_grads(model: torch.nn.Module) -> dict:
    """Unsharded parameters and last-step gradients, by state-dict name."""
    params, grads = {}, {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        params[name] = full(p.detach()).clone()
        grads[name] = full(p.grad).clone()
    return {"params": params, "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default="", help="checkpoint the ep2 float32 run here")
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {}
    for layout in cli.layouts.split(","):
        for dtype in DTYPES:
            ckpt = cli.ckpt if (layout, dtype) == ("ep2", "float32") else ""
            results[f"{layout}/{dtype}"] = run_layout(layout, dtype, world_size, ckpt)
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

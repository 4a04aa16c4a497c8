"""`moe_parity_worker` on a tiny gpt-oss (sinks, a sliding-window layer, biased router and
experts): 2 float64 training steps under ep = 2 and tp = 2 on 2 gloo ranks, rank 0 saves the
results.

Launched by tests/test_gpt_oss.py with torchrun; `run_layout(None, ...)` in-process is the
1-rank reference. float64 only: its 1e-10 bound is the exactness check (float32 would repeat it
at 1e-5 for twice the run time).
"""

import argparse
import contextlib

import moe_parity_worker
import torch
import torch.distributed as dist

from titanrl.distributed import init_distributed
from titanrl.models.args import TransformerModelArgs

GPT_OSS_ARGS = TransformerModelArgs(
    family="gpt_oss",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=32,
    vocab_size=128,
    qkv_bias=True,
    o_bias=True,
    max_seq_len=32,
    moe_num_experts=4,
    moe_top_k=2,
    moe_intermediate_size=32,
    moe_norm_topk_prob=False,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
)
# (dp_shard, tp, ep): experts split over 2 ranks; attention heads and their sinks split.
GPT_OSS_LAYOUTS = {"ep2": (2, 1, 2), "tp2": (1, 2, 1)}


@contextlib.contextmanager
def _gpt_oss_model():
    """moe_parity_worker's model and layouts swapped for gpt-oss's, restored after: the pytest
    process that imports this module also runs tests/test_moe_parallel.py."""
    saved = moe_parity_worker.MOE_ARGS, moe_parity_worker.LAYOUTS
    moe_parity_worker.MOE_ARGS, moe_parity_worker.LAYOUTS = GPT_OSS_ARGS, GPT_OSS_LAYOUTS
    try:
        yield
    finally:
        moe_parity_worker.MOE_ARGS, moe_parity_worker.LAYOUTS = saved


def run_layout(layout: str | None, world_size: int) -> dict:
    with _gpt_oss_model():
        return moe_parity_worker.run_layout(layout, "float64", world_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {layout: run_layout(layout, world_size) for layout in GPT_OSS_LAYOUTS}
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""`moe_parity_worker` on a tiny gpt-oss (sinks, a sliding-window layer, biased router and
experts): 2 training steps under ep = 2 and tp = 2 on 2 gloo ranks, rank 0 saves the results.

Launched by tests/test_gpt_oss.py with torchrun; `run_layout(None, ...)` in-process is the
1-rank reference.
"""

import moe_parity_worker

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
moe_parity_worker.MOE_ARGS = GPT_OSS_ARGS
moe_parity_worker.LAYOUTS["tp2"] = (1, 2, 1)  # (dp_shard, tp, ep): attention heads and sinks split
run_layout = moe_parity_worker.run_layout

if __name__ == "__main__":
    moe_parity_worker.main()

"""The model shapes the benchmarks share: written once here, so that "the debug flavor's shape"
means the same model in every benchmark (pinned: a change of the flavor in titanrl/models does
not silently change what the recorded numbers measured)."""

from titanrl.models import TransformerModelArgs
from titanrl.models.args import YarnRope

# Qwen3-like: QK-norm, grouped-query attention, tied embeddings, the byte tokenizer's 264 ids.
_QWEN3 = dict(family="qwen3", qk_norm=True, tie_word_embeddings=True, vocab_size=264, max_seq_len=512)


def qwen3_shape(**fields) -> TransformerModelArgs:
    """A Qwen3-like shape (QK-norm, tied embeddings, 264 tokens, 512 positions) with `fields`."""
    return TransformerModelArgs(**{**_QWEN3, **fields})


def debug_shape(**overrides) -> TransformerModelArgs:
    """The debug flavor's shape (4 layers of width 256, 4 query / 2 kv heads, a 768-wide MLP:
    3.2M parameters, matmul-bound on 2 CPU cores); any field given replaces its value."""
    return qwen3_shape(**{"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 768, **overrides})


# Negligible compute (1 layer, width 32): what is left of a decode step is framework overhead.
NEGLIGIBLE = qwen3_shape(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64)
# A tiny model (0.1M parameters): per-step framework overhead dominates.
TINY = qwen3_shape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)
# The debug shape 2x wider and deeper (dim 512, 8 layers) over a 4096-token vocabulary.
D512X8 = qwen3_shape(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1536, vocab_size=4096, max_seq_len=256)
# Two gpt-oss-20b layers (a 128-token sliding-window layer and a full-attention one; 64 query /
# 8 kv heads of 64 with sinks, 32 experts of width 2880, top-4, biased router; its 201,088-token
# vocabulary, untied head): 2.80B parameters, 0.25B active per token besides the embedding and
# head, so float32 AdamW state fits one GPU.
GPT_OSS_20B_2L = TransformerModelArgs(
    family="gpt_oss",
    dim=2880,
    n_layers=2,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    hidden_dim=2880,
    vocab_size=201088,
    norm_eps=1e-5,
    rope_theta=150000.0,
    rope_yarn=YarnRope(factor=32.0, original_max_position_embeddings=4096, truncate=False),
    max_seq_len=131072,
    qkv_bias=True,
    o_bias=True,
    moe_num_experts=32,
    moe_top_k=4,
    moe_intermediate_size=2880,
    moe_norm_topk_prob=False,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"],
)


def deepseek_v3_2l() -> TransformerModelArgs:
    """Two DeepSeek-V3-671B layers (the 61st-layer shapes: MLA with 128 heads, kv_lora_rank 512;
    one dense layer, one MoE layer) with 16 routed experts instead of 256 so that float32 AdamW
    state fits one GPU: top-8 of 8 groups (best 4), so a token's active compute is the real
    layers' (scripts/bench_gpu.sh --deepseek-only)."""
    import dataclasses

    from titanrl.models.flavors import get_model_args

    full = get_model_args("deepseek-v3-671b")
    return dataclasses.replace(full, n_layers=2, moe_mlp_only_layers=[0], moe_num_experts=16, max_seq_len=4096)

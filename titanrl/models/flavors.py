"""Named model shapes. Real sizes mirror the published HF configs so that checkpoints load."""

import copy
import difflib

from titanrl.models.args import RopeScaling, TransformerModelArgs

_QWEN_VOCAB = 151936
_LLAMA3_VOCAB = 128256

flavors: dict[str, TransformerModelArgs] = {
    # A few M params, trained from scratch on the embedded tasks with the byte tokenizer.
    "debug": TransformerModelArgs(
        family="qwen3",
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=768,
        vocab_size=264,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=256,
    ),
    # A teacher for the debug model (on-policy distillation recipe): ~3x its parameters.
    "debug-large": TransformerModelArgs(
        family="qwen3",
        dim=384,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        hidden_dim=1152,
        vocab_size=264,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=256,
    ),
    # The debug shape as a mixture of experts: 8 experts, top-2, the last layer dense.
    "debug-moe": TransformerModelArgs(
        family="qwen3_moe",
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=768,
        vocab_size=264,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=256,
        moe_num_experts=8,
        moe_top_k=2,
        moe_intermediate_size=384,
        moe_mlp_only_layers=[3],
    ),
    "qwen2.5-0.5b": TransformerModelArgs(
        family="qwen2",
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        hidden_dim=4864,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_seq_len=32768,
    ),
    "qwen2.5-1.5b": TransformerModelArgs(
        family="qwen2",
        dim=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        hidden_dim=8960,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_seq_len=32768,
    ),
    "qwen2.5-7b": TransformerModelArgs(
        family="qwen2",
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        hidden_dim=18944,
        vocab_size=152064,
        rope_theta=1e6,
        qkv_bias=True,
        max_seq_len=32768,
    ),
    "qwen3-0.6b": TransformerModelArgs(
        family="qwen3",
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=3072,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=40960,
    ),
    "qwen3-1.7b": TransformerModelArgs(
        family="qwen3",
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=6144,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=40960,
    ),
    "qwen3-8b": TransformerModelArgs(
        family="qwen3",
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=12288,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qk_norm=True,
        max_seq_len=40960,
    ),
    # Qwen3-30B-A3B: 128 experts, 8 active, every layer MoE (30.5B total, 3.3B active).
    "qwen3-30b-a3b": TransformerModelArgs(
        family="qwen3_moe",
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        vocab_size=_QWEN_VOCAB,
        rope_theta=1e6,
        qk_norm=True,
        max_seq_len=40960,
        moe_num_experts=128,
        moe_top_k=8,
        moe_intermediate_size=768,
    ),
    "llama3.2-1b": TransformerModelArgs(
        family="llama3",
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=8192,
        vocab_size=_LLAMA3_VOCAB,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0),
        tie_word_embeddings=True,
        max_seq_len=131072,
    ),
    "llama3.1-8b": TransformerModelArgs(
        family="llama3",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=14336,
        vocab_size=_LLAMA3_VOCAB,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=131072,
    ),
}


def get_model_args(flavor: str) -> TransformerModelArgs:
    """A copy of the named flavor's args (callers may change the copy)."""
    if flavor not in flavors:
        close = difflib.get_close_matches(flavor, list(flavors), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"Unknown model flavor '{flavor}'.{hint} Available: {', '.join(flavors)}")
    return copy.deepcopy(flavors[flavor])

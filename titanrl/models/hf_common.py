"""What every HF config.json that titanrl writes for a Llama-shaped family shares (dense, MoE,
gpt-oss, Qwen3.5): the transformer's shape under HF's key names. Each family's exporter adds
its own keys (`hf.py`, `hf_gpt_oss.py`, `hf_qwen3_5.py`)."""

from titanrl.models.args import TransformerModelArgs


def base_hf_config(args: TransformerModelArgs, architecture: str, model_type: str) -> dict:
    """architectures, model_type, sizes, heads, vocabulary, norm eps, context, tying, activation."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
    }

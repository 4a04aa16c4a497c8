"""What the HF mappings of every family share (`hf.py`, `hf_gpt_oss.py`, `hf_qwen3_5.py`,
`hf_deepseek.py`): weight-name tables and their lookup, and the config.json keys of the
transformer's shape. Each family's module adds its own names and keys."""

import re

from titanrl.models.args import TransformerModelArgs

# HF name -> titanrl name; "{}" is the layer index. Every family: embeddings, head and norms.
BASE_HF_TO_TITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
}

# Llama / Qwen attention (biases, QK-norm) and dense SwiGLU: the dense families and Qwen3.5.
DENSE_HF_TO_TITAN = {
    **BASE_HF_TO_TITAN,
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
}


def map_name(name: str, table: dict[str, str]) -> str | None:
    """`name` through `table` (its first layer index as "{}"); None when the table has no entry."""
    layer = re.search(r"\.(\d+)\.", name)
    template = name.replace(f".{layer.group(1)}.", ".{}.", 1) if layer else name
    target = table.get(template)
    if target is None:
        return None
    return target.format(layer.group(1)) if layer else target


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

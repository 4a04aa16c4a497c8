"""Hugging Face interop of Qwen3.5's text model (`qwen3_5_text`, `Qwen3_5ForCausalLM`), which
`models/hf.py` dispatches to.

Weight names map one to one (the gated DeltaNet keeps HF's names under `linear_attn`) but for
the RMSNorms: HF stores w and scales by 1 + w (zero-centred), titanrl stores the scale, so the
adapter adds 1 on import and subtracts it on export (exact in float32 for |w| < 1). The gated
norm inside `linear_attn` is a plain scale. The rows of `in_proj_qkv` and channels of `conv1d`
are permuted from HF's [q | k | v] to titanrl's key-head groups (`gated_deltanet.qkv_hf_order`),
the layout tensor parallelism shards. The multimodal checkpoints (`qwen3_5`, weights under
`model.language_model.`) load their text model; the vision tower and MTP head are left out.
"""

import re

import torch

from titanrl.models.args import TransformerModelArgs
from titanrl.models.gated_deltanet import qkv_hf_order
from titanrl.models.hf_common import DENSE_HF_TO_TITAN, base_hf_config, map_name

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
"""HF model_types this adapter reads (it writes qwen3_5_text)."""

_HF_TO_TITAN = dict(DENSE_HF_TO_TITAN)
_LINEAR_PARAMS: tuple[str, ...] = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
_LINEAR_PARAMS += ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
_HF_TO_TITAN.update({f"model.layers.{{}}.linear_attn.{p}": f"layers.{{}}.linear_attn.{p}" for p in _LINEAR_PARAMS})
_TITAN_TO_HF = {v: k for k, v in _HF_TO_TITAN.items()}
_OFFSET_NORMS = re.compile(r"(norm|layers\.\d+\.(attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm))\.weight")
"""titanrl names of the zero-centred RMSNorms."""
_MULTIMODAL_ONLY = re.compile(r"(model\.visual\.|mtp\.).*")
_QKV_ROWS = re.compile(r"layers\.\d+\.linear_attn\.(in_proj_qkv|conv1d)\.weight")
"""titanrl names of the tensors whose dim 0 is q | k | v (`qkv_hf_order`)."""


def args_from_hf_config(cfg: dict) -> TransformerModelArgs:
    """Model args of a qwen3_5_text config (or of a qwen3_5 config's text_config)."""
    top = cfg
    if cfg.get("model_type") == "qwen3_5":
        cfg = {"tie_word_embeddings": top.get("tie_word_embeddings", False), **cfg["text_config"]}
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act '{cfg['hidden_act']}'; titanrl implements SwiGLU (silu)")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Unsupported rope_type '{rope['rope_type']}' for qwen3_5_text; supported: default")
    n_layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    layer_types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
    ]
    bias = cfg.get("attention_bias", False)
    return TransformerModelArgs(
        family="qwen3_5",
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", 256),
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        layer_types=list(layer_types),
        attn_output_gate=True,
        partial_rotary_factor=rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)),
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
        linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
        linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
        linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
    )


def hf_config_from_args(args: TransformerModelArgs, dtype: torch.dtype) -> dict:
    """config.json of a Qwen3_5ForCausalLM for `args`."""
    if args.num_labels or args.moe_num_experts or args.qkv_bias != args.o_bias:
        raise ValueError("qwen3_5 exports only as a dense causal LM with qkv_bias == o_bias (HF attention_bias)")
    if not (args.qk_norm and args.attn_output_gate):
        raise ValueError("qwen3_5 exports only with qk_norm = true and attn_output_gate = true (its layout)")
    return {
        **base_hf_config(args, "Qwen3_5ForCausalLM", "qwen3_5_text"),
        "attention_bias": args.qkv_bias,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "layer_types": list(args.layer_types) or ["full_attention"] * args.n_layers,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """HF weights renamed to titanrl's, norm scales 1 + w; unknown names are errors."""
    sd = {}
    for hf_name, tensor in hf_sd.items():
        hf_name = hf_name.replace("model.language_model.", "model.", 1)
        if _MULTIMODAL_ONLY.fullmatch(hf_name):
            continue
        name = map_name(hf_name, _HF_TO_TITAN)
        if name is None:
            raise ValueError(f"Unexpected weight '{hf_name}' in the HF checkpoint; titanrl has no place for it")
        sd[name] = tensor + 1 if _OFFSET_NORMS.fullmatch(name) else tensor
        if _QKV_ROWS.fullmatch(name):
            sd[name] = tensor[qkv_hf_order(args)]
    if args.ties_output:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    hf_sd = {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.ties_output:
            continue
        hf_name = map_name(name, _TITAN_TO_HF)
        if hf_name is None:
            raise ValueError(f"titanrl weight '{name}' has no qwen3_5 HF name")
        hf_sd[hf_name] = tensor - 1 if _OFFSET_NORMS.fullmatch(name) else tensor
        if _QKV_ROWS.fullmatch(name):
            hf_sd[hf_name] = tensor[qkv_hf_order(args).argsort()]
    return hf_sd

"""Hugging Face interop of gpt-oss (`model_type` gpt_oss, `GptOssForCausalLM`): config.json <->
model args, and the weight layout (`hf.py` dispatches here).

HF keeps each layer's experts fused: `mlp.experts.gate_up_proj` [E, D, 2H] with gate and up
columns interleaved (gate = [..., ::2], up = [..., 1::2]; x @ W, not W x), its bias [E, 2H], and
`down_proj` [E, H, D] with its bias [E, D]. titanrl's grouped experts are w1 (gate) / w3 (up)
[E, H, D] and w2 [E, D, H] with biases b1 / b3 [E, H] and b2 [E, D]: transposes and strided
slices, so import then export gives the same bits. The released checkpoints store the experts
MXFP4-quantised (`*_blocks` / `*_scales`); those are refused with the fix (a bf16 copy).
"""

import re

import torch

from titanrl.models.args import TransformerModelArgs, YarnRope
from titanrl.models.hf_common import BASE_HF_TO_TITAN, base_hf_config, map_name

# HF name -> titanrl name; "{}" is the layer index.
_HF_TO_TITAN = {
    **BASE_HF_TO_TITAN,
    "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks",
    "model.layers.{}.mlp.router.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.router.bias": "layers.{}.moe.router.gate.bias",
    **{
        f"model.layers.{{}}.self_attn.{hf}_proj.{kind}": f"layers.{{}}.attention.w{titan}.{kind}"
        for hf, titan in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"))
        for kind in ("weight", "bias")
    },
}
_TITAN_TO_HF = {v: k for k, v in _HF_TO_TITAN.items()}
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_TITAN_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w3|b1|b3|w2|b2)")
_MXFP4 = re.compile(r".*\.experts\.\w+_(blocks|scales)")


def _yarn_from_hf(rope: dict) -> YarnRope | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"Unsupported rope_type '{rope_type}' for gpt_oss; supported: default, yarn")
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ValueError("Unsupported yarn mscale / mscale_all_dim for gpt_oss (DeepSeek's variant)")
    return YarnRope(
        factor=float(rope["factor"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=float(rope.get("attention_factor") or 0.0),
    )


def gpt_oss_args_from_hf_config(cfg: dict) -> TransformerModelArgs:
    """Model args of a gpt_oss config.json (transformers 4.55+ / 5.x)."""
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"This gpt_oss checkpoint is quantised ({method}); titanrl loads bf16 / fp32 weights: "
            "save a dequantised copy first (transformers: Mxfp4Config(dequantize=True), then save_pretrained)"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    n_layers, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
    ]
    return TransformerModelArgs(
        family="gpt_oss",
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 150000.0))),
        rope_yarn=_yarn_from_hf(rope),
        max_seq_len=cfg.get("max_position_embeddings", 131072),
        qkv_bias=cfg.get("attention_bias", True),
        o_bias=cfg.get("attention_bias", True),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        moe_num_experts=cfg.get("num_local_experts", cfg.get("num_experts", 128)),
        moe_top_k=cfg.get("num_experts_per_tok", 4),
        moe_intermediate_size=cfg["intermediate_size"],
        moe_norm_topk_prob=False,
        sliding_window=cfg.get("sliding_window") or 0,
        layer_types=list(layer_types),
        swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
        swiglu_limit=cfg.get("swiglu_limit", 7.0),
    )


def gpt_oss_hf_config(args: TransformerModelArgs, dtype: torch.dtype) -> dict:
    """config.json contents of a gpt-oss model."""
    if args.qkv_bias != args.o_bias or args.qk_norm or args.num_labels:
        raise ValueError("gpt_oss exports with qkv_bias == o_bias, no qk_norm and a language-model head")
    if args.moe_shared_experts or args.moe_expert_bias or args.moe_mlp_only_layers or args.moe_decoder_sparse_step != 1:
        raise ValueError("gpt_oss has every layer MoE, no shared experts and no expert bias: export needs them off")
    if args.moe_hidden_dim != args.hidden_dim:
        raise ValueError("gpt_oss has one intermediate_size: export needs moe_intermediate_size == hidden_dim")
    rope: dict = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_yarn is not None:
        y = args.rope_yarn
        rope.update(
            rope_type="yarn",
            factor=y.factor,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            original_max_position_embeddings=y.original_max_position_embeddings,
            truncate=y.truncate,
        )
        if y.attention_factor:
            rope["attention_factor"] = y.attention_factor
    return {
        **base_hf_config(args, "GptOssForCausalLM", "gpt_oss"),
        "attention_bias": args.qkv_bias,
        "rope_parameters": rope,
        "rope_theta": args.rope_theta,
        "num_local_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "sliding_window": args.sliding_window or None,
        "layer_types": list(args.layer_types) or ["full_attention"] * args.n_layers,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def gpt_oss_from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """HF gpt-oss weights -> titanrl names and layout; unknown names are errors."""
    sd = {}
    for hf_name, tensor in hf_sd.items():
        if _MXFP4.fullmatch(hf_name):
            raise ValueError(f"'{hf_name}' is MXFP4-quantised: load a dequantised (bf16) gpt-oss checkpoint")
        if m := _HF_EXPERTS.fullmatch(hf_name):
            prefix = f"layers.{m.group(1)}.moe.experts"
            if m.group(2) == "down_proj":
                sd[f"{prefix}.b2" if m.group(3) else f"{prefix}.w2"] = tensor if m.group(3) else tensor.transpose(1, 2)
            elif m.group(3):
                sd[f"{prefix}.b1"], sd[f"{prefix}.b3"] = tensor[:, ::2], tensor[:, 1::2]
            else:
                sd[f"{prefix}.w1"], sd[f"{prefix}.w3"] = (
                    tensor[..., ::2].transpose(1, 2),
                    tensor[..., 1::2].transpose(1, 2),
                )
            continue
        name = map_name(hf_name, _HF_TO_TITAN)
        if name is None:
            raise ValueError(f"Unexpected weight '{hf_name}' in the HF gpt_oss checkpoint; titanrl has no place for it")
        sd[name] = tensor
    if args.ties_output:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return {k: v.contiguous() for k, v in sd.items()}


def gpt_oss_to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """titanrl gpt-oss weights -> HF names and fused, interleaved expert layout."""
    hf_sd: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.ties_output:
            continue
        if m := _TITAN_EXPERTS.fullmatch(name):
            experts.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        hf_name = map_name(name, _TITAN_TO_HF)
        if hf_name is None:
            raise ValueError(f"titanrl weight '{name}' has no HF gpt_oss name")
        hf_sd[hf_name] = tensor
    for layer, w in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([w["w1"].transpose(1, 2), w["w3"].transpose(1, 2)], dim=-1)
        hf_sd[f"{prefix}.gate_up_proj"] = gate_up.flatten(-2)
        hf_sd[f"{prefix}.gate_up_proj_bias"] = torch.stack([w["b1"], w["b3"]], dim=-1).flatten(-2)
        hf_sd[f"{prefix}.down_proj"] = w["w2"].transpose(1, 2).contiguous()
        hf_sd[f"{prefix}.down_proj_bias"] = w["b2"]
    return hf_sd

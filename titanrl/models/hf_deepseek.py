"""Hugging Face interop of DeepSeek-V3 (`deepseek_v3`, `DeepseekV3ForCausalLM`; Kimi K2 and
Moonlight share it): config.json <-> model args and weight names, registered in `hf.py`.

Layers below `first_k_dense_replace` are dense SwiGLU (`moe_mlp_only_layers`), the others MoE
with sigmoid scores, `e_score_correction_bias` (titanrl's `moe.expert_bias`, for the choice of
experts only), group-limited top-k and shared experts. Multi-token-prediction layers
(`model.layers.{n >= num_hidden_layers}`) are skipped with one notice: titanrl trains and
generates with the main model only, so an export has none (`num_nextn_predict_layers` 0).
"""

import logging
import re

import torch

from titanrl.models.args import TransformerModelArgs, YarnRope
from titanrl.models.hf import _stack_hf_experts
from titanrl.models.hf_common import BASE_HF_TO_TITAN, map_name

logger = logging.getLogger(__name__)

_ATTN = "model.layers.{}.self_attn."
_HF_TO_TITAN = {
    **BASE_HF_TO_TITAN,
    _ATTN + "q_proj.weight": "layers.{}.attention.wq.weight",
    _ATTN + "q_a_proj.weight": "layers.{}.attention.wq_a.weight",
    _ATTN + "q_a_proj.bias": "layers.{}.attention.wq_a.bias",
    _ATTN + "q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
    _ATTN + "q_b_proj.weight": "layers.{}.attention.wq_b.weight",
    _ATTN + "kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
    _ATTN + "kv_a_proj_with_mqa.bias": "layers.{}.attention.wkv_a.bias",
    _ATTN + "kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
    _ATTN + "kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
    _ATTN + "o_proj.weight": "layers.{}.attention.wo.weight",
    _ATTN + "o_proj.bias": "layers.{}.attention.wo.bias",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias",
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
    "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
}
_TITAN_TO_HF = {v: k for k, v in _HF_TO_TITAN.items()}
_HF_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\..*")
_TITAN_EXPERT_KEY = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _yarn_from_hf(rope: dict, max_position_embeddings: int) -> YarnRope:
    original = rope["original_max_position_embeddings"]
    return YarnRope(
        factor=float(rope.get("factor") or max_position_embeddings / original),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
    )


def _check_supported(cfg: dict, rope_type: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act '{cfg['hidden_act']}'; titanrl implements SwiGLU (silu)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("deepseek_v3 supports scoring_func 'sigmoid' with topk_method 'noaux_tc' only")
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"Unsupported deepseek_v3 rope_type '{rope_type}'; supported: default, yarn")
    if cfg.get("rope_parameters", {}).get("attention_factor") is not None:
        raise ValueError("Unsupported rope_parameters.attention_factor; titanrl derives it from mscale")


def deepseek_args_from_hf_config(cfg: dict) -> TransformerModelArgs:
    """Model args of a deepseek_v3 config.json (transformers 4.x or 5.x rope layout)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _check_supported(cfg, rope_type)
    max_pos = cfg.get("max_position_embeddings", 4096)
    n_layers = cfg["num_hidden_layers"]
    return TransformerModelArgs(
        family="deepseek_v3",
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg["num_attention_heads"],
        head_dim=cfg["qk_rope_head_dim"],
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_seq_len=max_pos,
        o_bias=cfg.get("attention_bias", False),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        moe_num_experts=cfg.get("n_routed_experts") or 0,
        moe_top_k=cfg.get("num_experts_per_tok") or 1,
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        moe_shared_experts=cfg.get("n_shared_experts") or 0,
        moe_mlp_only_layers=list(range(min(cfg.get("first_k_dense_replace") or 0, n_layers))),
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_expert_bias=bool(cfg.get("n_routed_experts")),
        kv_lora_rank=cfg["kv_lora_rank"],
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=cfg.get("rope_interleave", True),
        rope_yarn=_yarn_from_hf(rope, max_pos) if rope_type == "yarn" else None,
        moe_score_func="sigmoid",
        moe_n_group=cfg.get("n_group") or 1,
        moe_topk_group=cfg.get("topk_group") or 1,
        moe_routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_mtp_layers=cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0,
    )


def _rope_hf(args: TransformerModelArgs) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_yarn is not None:
        y = args.rope_yarn
        rope.update(rope_type="yarn", factor=y.factor, beta_fast=y.beta_fast, beta_slow=y.beta_slow)
        rope.update(original_max_position_embeddings=y.original_max_position_embeddings)
        rope.update({k: v for k, v in (("mscale", y.mscale), ("mscale_all_dim", y.mscale_all_dim)) if v})
    return rope


def _check_exportable(args: TransformerModelArgs) -> None:
    dense = list(range(len(args.moe_mlp_only_layers)))
    if args.moe_mlp_only_layers != dense or args.moe_decoder_sparse_step != 1:
        raise ValueError("deepseek_v3 exports only with its first layers dense (moe_mlp_only_layers = 0..k-1)")
    if args.moe_num_experts and (args.moe_score_func != "sigmoid" or not args.moe_expert_bias):
        raise ValueError("deepseek_v3 exports only with moe_score_func 'sigmoid' and moe_expert_bias on")
    if args.qkv_bias:
        raise ValueError("deepseek_v3 has no qkv_bias; its attention_bias is o_bias")


def deepseek_hf_config(args: TransformerModelArgs, dtype: torch.dtype) -> dict:
    """config.json contents of a deepseek_v3 `args`."""
    _check_exportable(args)
    rope = _rope_hf(args)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.moe_shared_experts,
        "n_routed_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "routed_scaling_factor": args.moe_routed_scaling_factor,
        "n_group": args.moe_n_group,
        "topk_group": args.moe_topk_group,
        "norm_topk_prob": args.moe_norm_topk_prob,
        "first_k_dense_replace": len(args.moe_mlp_only_layers) if args.moe_num_experts else args.n_layers,
        "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.o_bias,
        "hidden_act": "silu",
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "rope_parameters": rope,
        "rope_theta": args.rope_theta,  # transformers 4.x spelling
        "rope_scaling": None if args.rope_yarn is None else dict(rope),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def deepseek_from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """titanrl names of a deepseek_v3 checkpoint's weights; MTP layers skipped with one notice."""
    main = {}
    for hf_name, tensor in hf_sd.items():
        layer = _LAYER.match(hf_name)
        if layer is None or int(layer.group(1)) < args.n_layers:
            main[hf_name] = tensor
    if len(main) < len(hf_sd):
        logger.warning(
            "Skipping %d weights of the checkpoint's multi-token-prediction layers (model.layers.%d+): "
            "titanrl trains and generates with the main model only",
            len(hf_sd) - len(main),
            args.n_layers,
        )
    sd = _stack_hf_experts(main)
    for hf_name, tensor in main.items():
        if _HF_EXPERT.fullmatch(hf_name) or hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = map_name(hf_name, _HF_TO_TITAN)
        if name is None:
            raise ValueError(f"Unexpected weight '{hf_name}' in the HF checkpoint; titanrl has no place for it")
        sd[name] = tensor
    if args.ties_output:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def deepseek_to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """HF names of a deepseek_v3 model's weights (experts split per expert)."""
    hf_sd = {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.ties_output:
            continue
        if m := _TITAN_EXPERT_KEY.fullmatch(name):
            for e, expert in enumerate(tensor.unbind(0)):
                hf_sd[f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_PROJ[m.group(2)]}.weight"] = expert
            continue
        hf_name = map_name(name, _TITAN_TO_HF)
        if hf_name is None:
            raise ValueError(f"titanrl weight '{name}' has no deepseek_v3 HF name")
        hf_sd[hf_name] = tensor
    return hf_sd

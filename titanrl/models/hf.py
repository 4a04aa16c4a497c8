"""Hugging Face interop: config.json <-> model args, safetensors (sharded or not) <-> state dict.

Supported `model_type`s: llama, qwen2, qwen3, qwen3_moe (the `*ForCausalLM` layouts), and
qwen3_5_text, gpt_oss and deepseek_v3 (their mappings in `hf_qwen3_5.py`, `hf_gpt_oss.py` and
`hf_deepseek.py`, dispatched from here). Weight names map one-to-one but for Qwen3-MoE's experts:
HF stores `mlp.experts.{e}.gate_proj / up_proj / down_proj` per expert; titanrl stacks them in
expert order into `moe.experts.w1 / w3 / w2` [E, ...] on import and splits them on export. q/k
need no permutation because titanrl applies RoPE in HF's rotate-half layout.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titanrl.models import hf_qwen3_5
from titanrl.models.args import Family, RopeScaling, TransformerModelArgs
from titanrl.models.hf_common import DENSE_HF_TO_TITAN, base_hf_config, map_name
from titanrl.models.hf_gpt_oss import (
    gpt_oss_args_from_hf_config,
    gpt_oss_from_hf_state_dict,
    gpt_oss_hf_config,
    gpt_oss_to_hf_state_dict,
)
from titanrl.models.lora import is_lora_key, lora_modules, merge_lora_state_dict
from titanrl.models.model import Transformer

if TYPE_CHECKING:
    from titanrl.config.job_config import JobConfig

# family -> (HF model_type, HF architecture)
_HF_FAMILIES: dict[Family, tuple[str, str]] = {
    "llama3": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # `hf_deepseek.py`
}
_FAMILY_OF_MODEL_TYPE = {model_type: family for family, (model_type, _) in _HF_FAMILIES.items()}

_HF_TO_TITAN = {**DENSE_HF_TO_TITAN, "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight"}
_TITAN_TO_HF = {v: k for k, v in _HF_TO_TITAN.items()}
# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Qwen3-MoE experts: HF projection -> titanrl grouped weight.
_EXPERT_PROJ_TO_TITAN = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_HF_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# transformers 5's in-memory fused layout, accepted on import: gate_up_proj [E, 2H, D] (gate
# rows first), down_proj [E, D, H].
_HF_FUSED_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_TITAN_EXPERT_KEY = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")


def _num_labels(cfg: dict) -> int:
    """Outputs of the score head of a `*ForSequenceClassification` config, 0 for a causal LM."""
    if not any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or []):
        return 0
    return len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2)


def args_from_hf_config(cfg: dict) -> TransformerModelArgs:
    """Model args from a parsed HF config.json (transformers 4.x or 5.x rope layout)."""
    model_type = cfg.get("model_type")
    if model_type in hf_qwen3_5.MODEL_TYPES:
        return hf_qwen3_5.args_from_hf_config(cfg)
    if model_type not in _FAMILY_OF_MODEL_TYPE:
        raise ValueError(f"Unsupported HF model_type '{model_type}'; supported: {', '.join(_FAMILY_OF_MODEL_TYPE)}")
    family = _FAMILY_OF_MODEL_TYPE[model_type]
    if family == "gpt_oss":
        return gpt_oss_args_from_hf_config(cfg)
    if family == "deepseek_v3":
        from titanrl.models import hf_deepseek  # which builds on this module

        return hf_deepseek.deepseek_args_from_hf_config(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act '{cfg['hidden_act']}'; titanrl implements SwiGLU (silu)")
    if cfg.get("mlp_bias", False):
        raise ValueError("Unsupported mlp_bias=true; titanrl's SwiGLU has no biases")
    if cfg.get("use_sliding_window", False):
        raise ValueError("Unsupported use_sliding_window=true; titanrl implements full causal attention")
    # transformers 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        rope_scaling = None
    elif rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    else:
        raise ValueError(f"Unsupported rope_type '{rope_type}'; supported: default, llama3")
    attention_bias = cfg.get("attention_bias", False)
    n_heads = cfg["num_attention_heads"]
    return TransformerModelArgs(
        family=family,
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        hidden_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama/Qwen3 use attention_bias for all four.
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        num_labels=_num_labels(cfg),
        **_moe_args_from_hf_config(cfg),
    )


def _moe_args_from_hf_config(cfg: dict) -> dict:
    """The `moe_*` args of a qwen3_moe config (transformers 5 writes `num_local_experts`)."""
    if cfg.get("model_type") != "qwen3_moe":
        return {}
    return dict(
        moe_num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 128)),
        moe_top_k=cfg.get("num_experts_per_tok", 8),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
        moe_decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
        moe_mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        moe_norm_topk_prob=cfg.get("norm_topk_prob", False),
    )


def _moe_hf_config(args: TransformerModelArgs) -> dict:
    if args.family != "qwen3_moe":
        if args.moe_num_experts:
            raise ValueError(f"A {args.family} model exports only dense; MoE exports as the qwen3_moe family")
        return {}
    if args.moe_shared_experts or args.moe_expert_bias:
        raise ValueError("Qwen3-MoE has no shared experts and no expert bias: export needs both off")
    return {
        "num_experts": args.moe_num_experts,
        "num_experts_per_tok": args.moe_top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "decoder_sparse_step": args.moe_decoder_sparse_step,
        "mlp_only_layers": list(args.moe_mlp_only_layers),
        "norm_topk_prob": args.moe_norm_topk_prob,
    }


def hf_config_from_args(args: TransformerModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json contents for `args`, readable by transformers 4.x and 5.x."""
    if args.family == "qwen3_5":
        return hf_qwen3_5.hf_config_from_args(args, dtype)
    if args.family == "gpt_oss":
        return gpt_oss_hf_config(args, dtype)
    if args.family == "deepseek_v3":
        from titanrl.models import hf_deepseek

        return hf_deepseek.deepseek_hf_config(args, dtype)
    model_type, architecture = _HF_FAMILIES[args.family]
    if args.num_labels:
        architecture = architecture.replace("ForCausalLM", "ForSequenceClassification")
    if args.family == "qwen2" and not (args.qkv_bias and not args.o_bias):
        raise ValueError("A qwen2 model exports only with qkv_bias=True and o_bias=False (the Qwen2 layout)")
    if args.family != "qwen2" and args.qkv_bias != args.o_bias:
        raise ValueError(f"A {args.family} model exports only with qkv_bias == o_bias (HF attention_bias)")
    if args.qk_norm != (args.family in ("qwen3", "qwen3_moe")):
        raise ValueError("qk_norm exports only as the qwen3 or qwen3_moe family")
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope.update(
            rope_type="llama3",
            factor=args.rope_scaling.factor,
            low_freq_factor=args.rope_scaling.low_freq_factor,
            high_freq_factor=args.rope_scaling.high_freq_factor,
            original_max_position_embeddings=args.rope_scaling.original_max_position_embeddings,
        )
    cfg = {
        **base_hf_config(args, architecture, model_type),
        "rope_parameters": rope,
        # Legacy (transformers 4.x) spelling of the same RoPE settings.
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling is None else dict(rope),
        "torch_dtype": str(dtype).removeprefix("torch."),
        **_moe_hf_config(args),
    }
    if args.family != "qwen2":
        cfg["attention_bias"] = args.qkv_bias
    if args.num_labels:
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(args.num_labels)}
    return cfg


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF weights to titanrl names; unknown names are errors, not silently dropped."""
    if args.family == "qwen3_5":
        return hf_qwen3_5.from_hf_state_dict(hf_sd, args)
    if args.family == "gpt_oss":
        return gpt_oss_from_hf_state_dict(hf_sd, args)
    if args.family == "deepseek_v3":
        from titanrl.models import hf_deepseek

        return hf_deepseek.deepseek_from_hf_state_dict(hf_sd, args)
    sd = _stack_hf_experts(hf_sd)
    for hf_name, tensor in hf_sd.items():
        if _IGNORED_HF_KEYS.fullmatch(hf_name) or _HF_EXPERT_KEY.fullmatch(hf_name):
            continue
        if _HF_FUSED_EXPERT_KEY.fullmatch(hf_name):
            continue
        name = "output.weight" if hf_name == "score.weight" and args.num_labels else map_name(hf_name, _HF_TO_TITAN)
        if name is None:
            raise ValueError(f"Unexpected weight '{hf_name}' in the HF checkpoint; titanrl has no place for it")
        sd[name] = tensor
    if args.ties_output:
        # Tied checkpoints may or may not carry lm_head; the embedding is the one source of truth.
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def _stack_hf_experts(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """titanrl's grouped `layers.{l}.moe.experts.w1 / w2 / w3` from HF's per-expert (or fused)
    weights, experts stacked in index order; a missing expert is an error."""
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    sd = {}
    for hf_name, tensor in hf_sd.items():
        if m := _HF_EXPERT_KEY.fullmatch(hf_name):
            name = f"layers.{m.group(1)}.moe.experts.{_EXPERT_PROJ_TO_TITAN[m.group(3)]}"
            per_expert.setdefault(name, {})[int(m.group(2))] = tensor
        elif m := _HF_FUSED_EXPERT_KEY.fullmatch(hf_name):
            prefix = f"layers.{m.group(1)}.moe.experts"
            if m.group(2) == "down_proj":
                sd[f"{prefix}.w2"] = tensor
            else:
                sd[f"{prefix}.w1"], sd[f"{prefix}.w3"] = tensor.chunk(2, dim=1)
    for name, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ValueError(f"HF checkpoint lacks experts {missing[:5]} of '{name}'")
        sd[name] = torch.stack([experts[e] for e in range(len(experts))])
    return sd


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    if args.family == "qwen3_5":
        return hf_qwen3_5.to_hf_state_dict(sd, args)
    if args.family == "gpt_oss":
        return gpt_oss_to_hf_state_dict(sd, args)
    if args.family == "deepseek_v3":
        from titanrl.models import hf_deepseek

        return hf_deepseek.deepseek_to_hf_state_dict(sd, args)
    hf_sd = {}
    for name, tensor in sd.items():
        if name == "output.weight" and args.ties_output:
            continue
        if m := _TITAN_EXPERT_KEY.fullmatch(name):
            proj = {v: k for k, v in _EXPERT_PROJ_TO_TITAN.items()}[m.group(2)]
            for e, expert in enumerate(tensor.unbind(0)):
                hf_sd[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight"] = expert
            continue
        hf_name = "score.weight" if name == "output.weight" and args.num_labels else map_name(name, _TITAN_TO_HF)
        if hf_name is None:
            raise ValueError(f"titanrl weight '{name}' has no HF name (adapter table out of date)")
        hf_sd[hf_name] = tensor
    return hf_sd


def load_safetensors_folder(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        sd = {}
        for shard in sorted(set(weight_map.values())):
            sd.update(load_file(os.path.join(folder, shard)))
        missing = set(weight_map) - set(sd)
        if missing:
            raise ValueError(f"{index_path} lists weights missing from its shards: {sorted(missing)[:5]}")
        return sd
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"No model.safetensors or {SAFETENSORS_INDEX} in '{folder}'")
    return load_file(single)


def save_safetensors_folder(sd: dict[str, torch.Tensor], folder: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write `sd` as one file, or as shards plus an index when it exceeds `max_shard_bytes`."""
    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in sd.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().contiguous().clone()
        shard_bytes += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, filename), metadata=metadata)
        weight_map.update({name: filename for name in shard})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(folder, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def read_generation_eos_ids(folder: str) -> tuple[int, ...]:
    """The stop tokens of a model folder's generation_config.json (`eos_token_id`: one id or a
    list; chat models list several), or () without one."""
    path = os.path.join(folder, "generation_config.json")
    if not folder or not os.path.exists(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return tuple(ids)


def read_hf_config(folder: str) -> TransformerModelArgs:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"No config.json in '{folder}' (expected a Hugging Face model folder)")
    with open(path) as f:
        return args_from_hf_config(json.load(f))


def _full_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the CPU (collective): a model's values are all tensors
    (`ValueType`, its annotation, also covers optimizer states)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], sd)


def load_hf_weights(model: Transformer, folder: str) -> None:
    """Load HF safetensors into `model`, which may be plain, FSDP2-sharded and/or TP-sharded.

    Every rank reads the files (a shared filesystem is assumed) and keeps only its shard.
    """
    sd = from_hf_state_dict(load_safetensors_folder(folder), model.args)
    keys = set(get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)))
    expected = {k for k in keys if not is_lora_key(k)}  # LoRA adapters are not in a base checkpoint
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ValueError(
            f"HF checkpoint '{folder}' does not match the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]} (is config.json from the same model?)"
        )
    options = StateDictOptions(full_state_dict=True, strict=expected == keys)
    set_model_state_dict(model, sd, options=options)  # type: ignore[arg-type]  # the stub's dict is invariant


def export_hf(
    model: Transformer,
    folder: str,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    merge_lora: bool = True,
) -> None:
    """Gather the full model on rank 0 and write config.json + safetensors there; LoRA adapters
    are merged into their base weights, or left out with `merge_lora=False` (the base model).

    Collective: every rank must call it.
    """
    sd = _full_state_dict(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return
    sd = merge_lora_state_dict(sd, model) if merge_lora else {k: v for k, v in sd.items() if not is_lora_key(k)}
    hf_config = hf_config_from_args(model.args, dtype)  # first: it names what HF cannot represent
    hf_sd = {k: v.to(dtype) for k, v in to_hf_state_dict(sd, model.args).items()}
    save_safetensors_folder(hf_sd, folder, max_shard_bytes)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


def export_peft_adapter(
    model: Transformer, folder: str, rank: int, alpha: float, dropout: float, base_model: str = ""
) -> None:
    """Write `model`'s LoRA adapters as a PEFT adapter folder (`adapter_config.json` +
    `adapter_model.safetensors`, PEFT's key layout) that `peft.PeftModel.from_pretrained` loads
    onto the HF export of the base model. Collective: every rank must call it."""
    sd = _full_state_dict(model)
    rank_id = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank_id != 0:
        return
    adapters, targets = {}, set()
    for name, _ in lora_modules(model):
        (hf_name,) = to_hf_state_dict({f"{name}.weight": sd[f"{name}.weight"]}, model.args)  # any family's names
        targets.add(hf_name.split(".")[-2])
        stem = "base_model.model." + hf_name.removesuffix(".weight")
        adapters[f"{stem}.lora_A.weight"] = sd[f"{name}.lora_a.weight"]
        adapters[f"{stem}.lora_B.weight"] = sd[f"{name}.lora_b.weight"]
    os.makedirs(folder, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in adapters.items()},
        os.path.join(folder, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def export_lora(model: Transformer, config: JobConfig) -> None:
    """`<dump_folder>/peft_adapter` for `model.hf_checkpoint` as the base, or, for a model trained
    from scratch, also its base weights in `<dump_folder>/hf_base`. Collective."""
    base = config.model.hf_checkpoint
    if not base:
        base = os.path.join(config.job.dump_folder, "hf_base")
        export_hf(model, base, merge_lora=False)
    lora = config.lora
    export_peft_adapter(
        model,
        os.path.join(config.job.dump_folder, "peft_adapter"),
        lora.rank,
        lora.alpha,
        lora.dropout,
        base_model=os.path.abspath(base),
    )

"""LoRA: low-rank adapters on a `Transformer`'s block projections (Hu et al., "LoRA: Low-rank
adaptation of large language models", arXiv:2106.09685).

A target projection W [out, in] becomes

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T,    A [r, in], B [out, r],

with W (and everything else in the model) frozen. A starts like an `nn.Linear` weight (Kaiming
uniform, PEFT's default), B at zero, so an adapted model starts as its base. Adapters are
submodules `lora_a` / `lora_b` of the adapted `LoRALinear`, so their parameter names are the base
name plus `.lora_a.weight` / `.lora_b.weight`; `titanrl.distributed.parallelize` shards them
consistently with their base weight (`LoRAParallel`), FSDP2 shards them with their block.

Adapters are added on the meta device, before parallelization (`add_lora`); their values are set
after the base weights are loaded (`init_lora`), identically on every rank for one seed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanrl.config.model import LORA_LINEAR_ATTN_TARGETS, LORA_TARGETS, lora_target
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.models.model import Transformer

# titanrl projection -> module inside a block
_TARGETS = {
    name: f"{'attention' if name in ('wq', 'wk', 'wv', 'wo') else 'feed_forward'}.{name}" for name in LORA_TARGETS
} | {name: f"linear_attn.{name}" for name in LORA_LINEAR_ATTN_TARGETS}


def resolve_targets(names: list[str]) -> list[str]:
    """titanrl names (wq, ..., w3) of `names`, which may use Hugging Face names (q_proj, ...)."""
    return list(dict.fromkeys(lora_target(name) for name in names))


class LoRALinear(nn.Linear):
    """An `nn.Linear` (the frozen base: `weight`, `bias`) plus a low-rank update B A."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank = rank
        self.scaling = alpha / rank
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapters_enabled = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """The adapted version of `linear`, sharing its weight and bias parameters."""
        w = linear.weight
        out = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            rank,
            alpha,
            dropout,
            device=w.device,
            dtype=w.dtype,
        )
        out.weight = w
        if linear.bias is not None:
            out.bias = linear.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return y
        # Dropout only where gradients flow: scoring passes (old logprobs, eval) stay deterministic.
        x_in = self.lora_dropout(x) if torch.is_grad_enabled() else x
        return y + self.lora_b(self.lora_a(x_in)) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def add_lora(model: Transformer, config: LoRAConfig) -> int:
    """Replace the target projections of every block of `model` (a `Transformer`, before
    parallelization) by `LoRALinear`s; returns how many were adapted."""
    targets = _block_targets(model, resolve_targets(config.target_modules))
    count = 0
    for layer_id, block in model.layers.items():
        for path in targets:
            if getattr(block, "moe", None) is not None and path.startswith("feed_forward."):
                raise ValueError(
                    f"[lora] target_modules names the feed-forward projection '{path.split('.')[-1]}', but layer "
                    f"{layer_id} is a mixture of experts (grouped expert weights, not linear layers): adapt only "
                    "the attention projections (target_modules = ['wq', 'wk', 'wv', 'wo'])"
                )
            parent_path, _, attr = path.rpartition(".")
            if getattr(block, parent_path, None) is None:
                continue  # a hybrid model's block has attention or linear attention, not both
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, attr)
            assert type(linear) is nn.Linear, f"{path} is a {type(linear).__name__}, not a plain nn.Linear"
            setattr(parent, attr, LoRALinear.from_linear(linear, config.rank, config.alpha, config.dropout))
            count += 1
    if count == 0:
        raise ValueError(
            f"[lora] no layer has the target_modules {config.target_modules}; name projections the model has "
            "(e.g. ['wq', 'wk', 'wv', 'wo'])"
        )
    return count


def _block_targets(model: Transformer, names: list[str]) -> list[str]:
    """Module paths inside a block for titanrl target names. Multi-head latent attention
    (DeepSeek-V3, `models/mla.py`) has no wk / wv: keys and values both come out of the latent
    projections, so wk and wv name `wkv_a` and `wkv_b`, and wq names `wq_a` and `wq_b` when
    queries are low-rank."""
    args = model.args
    if not args.kv_lora_rank:
        return [_TARGETS[name] for name in names]
    mla = {"wq": ["wq_a", "wq_b"] if args.q_lora_rank else ["wq"], "wk": ["wkv_a", "wkv_b"], "wo": ["wo"]}
    mla["wv"] = mla["wk"]
    paths = [f"attention.{p}" for name in names if name in mla for p in mla[name]]
    return list(dict.fromkeys(paths + [_TARGETS[name] for name in names if name not in mla]))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) of every adapted projection, names without wrapper prefixes."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield clean_fqn(name), module


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in lora_modules(model))


def is_lora_key(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


def freeze_base(model: nn.Module) -> None:
    """Only adapter parameters train; everything else (base weights, norms, embeddings) is frozen."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_key(name))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter off inside the block (the reference policy of a LoRA run)."""
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapters_enabled = True


def initial_lora_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) initial adapter weights: A Kaiming-uniform as `nn.Linear` (PEFT's
    default), B zero; the same on every rank for one seed."""
    gen = torch.Generator().manual_seed(seed + 7919)  # not the base init's stream
    sd = {}
    for name, module in lora_modules(model):
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)) of an [r, in] weight
        sd[f"{name}.lora_a.weight"] = torch.empty(module.rank, module.in_features).uniform_(
            -bound, bound, generator=gen
        )
        sd[f"{name}.lora_b.weight"] = torch.zeros(module.out_features, module.rank)
    return sd


def init_lora(model: nn.Module, seed: int) -> None:
    """Set the adapters of a materialised (possibly FSDP2 / TP-sharded) model to their initial values."""
    sd = initial_lora_state_dict(model, seed)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, sd, options=options)  # type: ignore[arg-type]  # the stub's dict is invariant


def merge_lora_state_dict(sd: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict of `model` with every adapter folded into its base weight,
    W + (alpha / r) B A, and the adapter entries dropped (a plain model's state dict)."""
    merged = {k: v for k, v in sd.items() if not is_lora_key(k)}
    for name, module in lora_modules(model):
        a, b = sd[f"{name}.lora_a.weight"], sd[f"{name}.lora_b.weight"]
        w = sd[f"{name}.weight"]
        merged[f"{name}.weight"] = (w.double() + module.scaling * (b.double() @ a.double())).to(w.dtype)
    return merged


def clean_fqn(name: str) -> str:
    """A module or parameter name without the wrappers' prefixes (activation checkpointing,
    torch.compile): the name in a bare model and in state dicts."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class AdaptersOff:
    """The base model of a LoRA policy, used where a model is expected (the RL reference policy):
    its `logprobs` are the policy's with every adapter off. Not a module: it owns no weights, so
    it is in no checkpoint and costs no memory."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def logprobs(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model.logprobs(*args, **kwargs)

"""Build the trainer's models: meta init -> parallelize -> materialise -> load weights.

Policies, references, critics and reward models are all `Transformer`s on the same mesh; a
critic or reward model has a one-label scalar head (`num_labels = 1`, HF's
`*ForSequenceClassification` layout: `score.weight` instead of the LM head).
"""

from dataclasses import replace
from typing import cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titanrl.components.float8 import convert_to_float8, has_float8_all_gather, reshard_float8_blocks_after_forward
from titanrl.config.job_config import JobConfig
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.distributed.parallelize import parallelize_model
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import from_hf_state_dict, load_hf_weights, load_safetensors_folder, read_hf_config
from titanrl.models.lora import AdaptersOff, add_lora, has_lora, init_lora, is_lora_key, merge_lora_state_dict
from titanrl.models.model import Transformer


def init_full_state_dict(model_args: TransformerModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """A freshly initialised, unsharded state dict on CPU, identical on every rank for one seed.

    Sharded models are initialised from it rather than by running `init_weights` on local
    shards: with the same seed on every rank, local shards would repeat the same numbers.
    """
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Transformer(model_args)
    model.init_weights()
    torch.random.set_rng_state(rng_state)
    return model.state_dict()


def build_model(
    model_args: TransformerModelArgs,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    hf_checkpoint: str = "",
    full_state_dict: dict[str, torch.Tensor] | None = None,
    lora: LoRAConfig | None = None,
    float8: bool = True,
) -> Transformer:
    """The parallelized model with weights from `hf_checkpoint`, `full_state_dict`, or a fresh
    init; with `lora`, adapters on the frozen base (`titanrl.models.lora`); with [float8] on
    (and `float8`, which a model that must stay in high precision turns off), float8 block
    linears (`titanrl.components.float8`)."""
    model = build_meta_model(model_args, parallel_dims, job_config, lora, float8)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    if hf_checkpoint:
        load_hf_weights(model, hf_checkpoint)
    else:
        if full_state_dict is None:
            full_state_dict = init_full_state_dict(model_args, job_config.job.seed)
        load_full_state_dict(model, full_state_dict)
    if lora is not None:
        init_lora(model, job_config.job.seed)
    return model


def build_meta_model(
    model_args: TransformerModelArgs,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    lora: LoRAConfig | None = None,
    float8: bool = True,
) -> Transformer:
    """`build_model`'s parallelized model on the meta device, before any memory is allocated
    (`titanrl plan` reads its shards' shapes)."""
    with torch.device("meta"):
        model = Transformer(model_args)
        if lora is not None:
            add_lora(model, lora)
    if float8 and job_config.float8.enable:
        # On the meta model, before TP and FSDP2 (TorchTitan's order): the parallel styles and
        # fully_shard must see Float8Linear and its float8-all-gather weight wrapper.
        convert_to_float8(model, job_config.float8, fsdp_sharded=parallel_dims.fsdp_enabled)
    parallelize_model(model, parallel_dims, job_config)
    if has_float8_all_gather(model):
        reshard_float8_blocks_after_forward(model)  # an unsharded float8 weight is unreadable
    return model


def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Set every weight of `model` from `sd`, but adapters, which `sd` need not have."""
    if has_lora(model):
        missing = {k for k in get_model_state_dict(model) if not is_lora_key(k)} - set(sd)
        assert not missing, f"state dict lacks {sorted(missing)[:5]}"
    options = StateDictOptions(full_state_dict=True, strict=not has_lora(model))
    set_model_state_dict(model, sd, options=options)  # type: ignore[arg-type]  # the stub's dict is invariant


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a (parallelized) model, on every rank."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return cast(dict[str, torch.Tensor], sd)  # a model's values are tensors (ValueType also covers optimizers')


def build_reference(
    policy: Transformer, dims: ParallelDims, config: JobConfig, device: torch.device
) -> Transformer | AdaptersOff:
    """The frozen reference policy: a copy of `policy`'s weights, or for a LoRA policy the policy
    itself with its adapters off (the base model, no second copy of the weights)."""
    if has_lora(policy):
        return AdaptersOff(policy)
    return build_model(policy.args, dims, config, device, full_state_dict=full_state_dict(policy)).requires_grad_(False)


@torch.no_grad()
def copy_weights(dst: nn.Module, src: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """dst's parameters := src's, by name, in place (same shapes and sharding), except `skip`;
    a LoRA `src` gives its merged weights W + (alpha / r) B A (`policy_state_dict`)."""
    if has_lora(src):
        sd = {k: v for k, v in policy_state_dict(src).items() if k not in skip}
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(dst, sd, options=options)  # type: ignore[arg-type]  # the stub's dict is invariant
        return
    src_params = dict(src.named_parameters())
    for name, param in dst.named_parameters():
        if name not in skip:
            param.copy_(src_params[name])


def policy_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of the function `policy` computes: adapters merged into their base."""
    return merge_lora_state_dict(full_state_dict(policy), policy)


def build_reward_model(
    folder: str, dims: ParallelDims, config: JobConfig, device: torch.device, policy_args: TransformerModelArgs
) -> Transformer:
    """A frozen one-label score model from an HF folder, checked against the policy's vocabulary."""
    args = read_hf_config(folder)
    if args.num_labels != 1:
        raise ValueError(
            f"reward.model_path '{folder}' is not a one-label sequence-classification model "
            f"(num_labels={args.num_labels}); export a *ForSequenceClassification with num_labels=1"
        )
    if args.vocab_size < policy_args.vocab_size:
        raise ValueError(
            f"reward model vocab ({args.vocab_size}) is smaller than the policy's ({policy_args.vocab_size}); "
            "the reward model must share the policy's tokenizer"
        )
    # A frozen scorer keeps its trained precision: float8 is for the models that train.
    return build_model(args, dims, config, device, hf_checkpoint=folder, float8=False).requires_grad_(False)


def build_critic(policy: Transformer, dims: ParallelDims, config: JobConfig, device: torch.device) -> Transformer:
    """A value model: from critic.hf_checkpoint, or the policy's current weights; a new head
    (zeros, so the first values are 0) unless the checkpoint already has a one-label head."""
    folder = config.critic.hf_checkpoint
    if folder:
        src_args = read_hf_config(folder)
        if src_args.num_labels not in (0, 1):
            raise ValueError(f"critic.hf_checkpoint '{folder}' has {src_args.num_labels} labels; need 0 (LM) or 1")
        sd = from_hf_state_dict(load_safetensors_folder(folder), src_args)
        args = replace(src_args, num_labels=1)
        if src_args.num_labels == 0:
            sd.pop("output.weight")
    else:
        args = replace(policy.args, num_labels=1)
        sd = {k: v for k, v in policy_state_dict(policy).items() if k != "output.weight"}
    sd.setdefault("output.weight", torch.zeros(1, args.dim))
    return build_model(args, dims, config, device, full_state_dict=sd)

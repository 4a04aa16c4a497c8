"""Build the trainer's model: meta init -> parallelize -> materialise -> load weights."""

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanrl.config.job_config import JobConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.distributed.parallelize import parallelize_model
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import load_hf_weights
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
) -> Transformer:
    """The parallelized model with weights from `hf_checkpoint`, `full_state_dict`, or a fresh init."""
    with torch.device("meta"):
        model = Transformer(model_args)
    parallelize_model(model, parallel_dims, job_config)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    if hf_checkpoint:
        load_hf_weights(model, hf_checkpoint)
    else:
        if full_state_dict is None:
            full_state_dict = init_full_state_dict(model_args, job_config.job.seed)
        set_model_state_dict(model, full_state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
    return model

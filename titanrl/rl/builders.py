"""What the RL job builds from its config for rollouts: the generator and the reward runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanrl.components.plugins import load_object
from titanrl.generator import Generator
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import read_generation_eos_ids
from titanrl.rewards.runner import RewardRunner

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from titanrl.config import JobConfig
    from titanrl.data.tasks import Task
    from titanrl.models.tokenizer import Tokenizer


def build_generator(
    config: JobConfig,
    model_args: TransformerModelArgs,
    device: torch.device,
    tokenizer: Tokenizer,
    tp_mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None,
) -> Generator:
    """The job's generator (its [generator] section, the training precision, the checkpoint's eos ids);
    `ep_mesh`: experts sharded over it as the trainer's are (`generator/ep_lockstep.py`)."""
    return Generator(
        model_args,
        config.generator,
        device,
        tp_mesh=tp_mesh,
        ep_mesh=ep_mesh,
        tokenizer=tokenizer,
        dtype=getattr(torch, config.training.mixed_precision_param),
        extra_eos_ids=read_generation_eos_ids(config.model.hf_checkpoint),
        lora=config.lora if config.lora.enable and config.lora.generator == "runtime" else None,
    )


def build_reward_runner(config: JobConfig, task: Task) -> RewardRunner:
    """Reward workers running reward.function, else the task's verifier."""
    r = config.reward
    reward_fn = load_object(r.function, "reward.function") if r.function else task
    if r.function and not callable(reward_fn):
        raise ValueError(f"reward.function '{r.function}' is not callable")
    return RewardRunner(reward_fn, r.num_workers, r.timeout_s, r.failure_reward, r.memory_limit_mb)

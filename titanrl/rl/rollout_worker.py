"""A rollout rank in one-step off-policy RL (`rollout.mode = "one_step"`,
`rl/one_step.py`): its own generator, reward workers and data shard; it generates and scores
batches for its paired trainer rank (`rl/remote_collector.py`) and takes the new weights as they
come."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from titanrl.algorithms import get_algorithm
from titanrl.components.launch import StopSignals, die_with_launcher, local_device, model_args
from titanrl.components.timer import PhaseTimer
from titanrl.components.watchdog import Watchdog
from titanrl.config import JobConfig
from titanrl.data.encode import PromptEncoder, fit_prompts
from titanrl.data.loader import load_data
from titanrl.data.prompts import build_prompt_loader, prompt_stream
from titanrl.distributed import set_determinism
from titanrl.envs.builtin import ALL_TASKS
from titanrl.models.tokenizer import build_tokenizer
from titanrl.rl.builders import build_generator, build_reward_runner
from titanrl.rl.one_step import STOP, receives_weights, recv_object, recv_weights, roles, send_object
from titanrl.rl.rollouts import RolloutCollector


@dataclass
class _Shard:
    dp_rank: int
    dp_size: int

    @property
    def data_rank(self) -> int:
        return self.dp_rank

    @property
    def data_size(self) -> int:
        return self.dp_size


@dataclass
class RolloutRankHost:
    """A rollout rank's `RolloutHost`: what `RolloutCollector` needs, without a model to train
    (its collector runs no collective over dp ranks: each rollout rank feeds its own trainer rank)."""

    config: JobConfig
    dims: Any  # a `_Shard`: the dp_rank / dp_size the collector reads
    tokenizer: Any
    encode_prompt: Any
    device: torch.device
    dp_group: dist.ProcessGroup | None = None  # never set: no collective over rollout ranks
    rank: int = dataclasses.field(default_factory=lambda: dist.get_rank() if dist.is_initialized() else 0)


class RolloutWorker:
    """A rollout rank: its own generator, reward workers and data shard; generates and scores
    batches for its trainer rank and takes the new weights as they come."""

    def __init__(self, config: JobConfig) -> None:
        r, cfg = roles(), config
        self.config, self.roles = config, r
        die_with_launcher()
        # SIGTERM / SIGUSR1 go to every rank: the trainer ranks stop at a step boundary with a
        # checkpoint and then stop this rank (`RemoteRolloutCollector.close`); it must not die first.
        self.stop_signals = StopSignals()
        set_determinism(cfg.job.seed, cfg.job.deterministic)
        tokenizer = build_tokenizer(cfg.model.tokenizer)
        args = model_args(cfg, tokenizer.vocab_size)
        encode = PromptEncoder.from_config(cfg.data, cfg.model.tokenizer, tokenizer)
        device = local_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        split = load_data(cfg, "prompts", ALL_TASKS)
        task, train, held_out = split.task, split.train, split.held_out
        train, _ = fit_prompts(cfg, args.max_seq_len, encode, train, held_out)
        self.generator = build_generator(cfg, args, device, tokenizer)
        self.rewards = build_reward_runner(cfg, task)
        baseline = get_algorithm(cfg.algorithm.name)(cfg.algorithm).needs_baseline_rollout
        host = RolloutRankHost(cfg, _Shard(r.index, r.num_pairs), tokenizer, encode, device)
        self.collector = RolloutCollector(host, self.generator, self.rewards, None, None, baseline)
        self.loader = build_prompt_loader(
            prompt_stream(train, task, cfg.job.seed), cfg.training.batch_size, r.index, r.num_pairs
        )
        self.watchdog = Watchdog(cfg.job.phase_timeout_s, -1)

    def run(self) -> None:
        r, cfg = self.roles, self.config
        message = recv_object(r)
        if message is STOP:
            return self.rewards.close()
        start = message["start"]
        batches = iter(self.loader)
        for _ in range(start - 1):  # a resumed run: the batches trained before its checkpoint
            next(batches)
        version, idle = 0, 0.0
        try:
            for step in range(start, cfg.training.steps + 1):
                began = time.perf_counter()
                if receives_weights(step, start, cfg.rollout.staleness):
                    received = recv_weights(self.generator.model, r)
                    if received is None:  # the trainer stopped early
                        break
                    version = received
                    if self.generator.allocator is not None:  # cached prefixes hold old weights' K/V
                        self.generator.allocator.reset_prefix_cache()
                idle += time.perf_counter() - began
                timer = PhaseTimer(self.watchdog, self.generator.device)
                train, generated = self.collector.collect(batches, step, timer)
                began = time.perf_counter()
                send_object(
                    {
                        "train": train,
                        "generated": generated,
                        "version": version,
                        "seconds": dict(timer.seconds),
                        "idle_s": idle,
                    },
                    r,
                )
                # Waiting for the trainer to take the batch is idle too: reported with the next one.
                idle = time.perf_counter() - began
        finally:
            self.rewards.close()

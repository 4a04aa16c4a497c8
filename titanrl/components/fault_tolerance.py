"""Per-step fault tolerance across replica groups with TorchFT (`[fault_tolerance]`).

Each replica group is a complete titanrl job (its own ranks, generator, rewards, FSDP2 / TP
inside). At every RL step the groups alive form a quorum through TorchFT's lighthouse
(`start_step`); a group that restarted receives the live peers' state (model, optimizers, lr
schedule, loader position, RNGs, step) over TorchFT's checkpoint transport, not from a checkpoint.
Gradients are summed over the quorum (`reduce_gradients`), as FSDP2 sums them over data-parallel
ranks, and so are the loss's token and sequence counts (`sum`): with every group alive a step is
the step of one job whose data-parallel ranks are all the groups' ranks. A group that dies takes
its share of the step's samples with it; the others commit the step without it
(`should_commit`). Every replica group iterates the same global prompt stream and trains its
slice of each global batch, so loader positions agree across groups and a healed group takes a
live peer's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from titanrl.components.console import get_logger
from titanrl.config.fault_tolerance import FaultTolerance as FTConfig

log = get_logger(__name__)


def _torchft():
    try:
        import torchft
    except ImportError as e:
        raise ValueError("[fault_tolerance] needs TorchFT: pip install torchft (the 'ft' extra)") from e
    return torchft


class FaultTolerance:
    """This replica group's TorchFT manager, and what a step asks of it."""

    def __init__(
        self,
        config: FTConfig,
        device: torch.device,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
    ) -> None:
        torchft = _torchft()
        timeout = timedelta(seconds=config.timeout_s)
        pg_class = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        pg = pg_class(timeout=timeout)
        self.config = config
        self.healed_s = 0.0
        self.healed = False
        self._load = load_state_dict
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=config.min_replicas,
            load_state_dict=self._healed,
            state_dict=state_dict,
            replica_id=f"titanrl_{config.replica_id}",
            lighthouse_addr=config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout,
            use_async_quorum=False,  # heal before the step generates: its rollouts use the healed weights
        )
        self.quorum_size = 0
        self.last_quorum_size = config.group_size

    def _healed(self, state: Any) -> None:
        self._load(state)
        self.healed = True

    def start_step(self, fresh: bool) -> None:
        """The step's quorum (a restarted group heals here, before it generates). `fresh`: the
        job's first step, nobody has trained yet: wait (up to fault_tolerance.start_wait_s) for
        every replica group to join, so that none starts the run alone."""
        self.healed, self.healed_s = False, 0.0
        deadline = time.monotonic() + (self.config.start_wait_s if fresh else 0.0)
        while True:
            began = time.perf_counter()
            self.manager.start_quorum()  # a new quorum without a commit: the step count stays
            self.quorum_size = self.manager.num_participants()
            if self.healed:  # the quorum, the peer's state over the transport, and loading it
                self.healed_s = time.perf_counter() - began
            if self.healed or self.quorum_size >= self.config.group_size or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if self.quorum_size != self.last_quorum_size:  # a group dropped (dead, hung) or back
            log.warning(
                f"fault tolerance: replica group {self.config.replica_id} is in a quorum of {self.quorum_size} "
                f"of {self.config.group_size} groups (the others are dead, hung or starting; the lighthouse's "
                "status page lists them)"
            )
            self.last_quorum_size = self.quorum_size

    def reduce_gradients(self, model: nn.Module) -> None:
        """Sum every gradient over the replica groups of the quorum."""
        works = [
            self.manager.allreduce(_local(p.grad), reduce_op=torch.distributed.ReduceOp.SUM)
            for p in model.parameters()
            if p.grad is not None
        ]
        for w in works:
            w.wait()

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the replica groups of the quorum (in place)."""
        self.manager.allreduce(value, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return value

    def should_commit(self) -> bool:
        """Whether every group of the quorum got through the step (else nobody steps)."""
        return self.manager.should_commit()

    def metrics(self) -> dict[str, float]:
        """The step's quorum size, the seconds its heal took (0: none), and the share of the
        global batch the step lost with the groups missing from the quorum."""
        missing = self.config.group_size - self.quorum_size
        return {
            "ft_quorum": float(self.quorum_size),
            "ft_heal_s": self.healed_s,
            "ft_lost_frac": missing / self.config.group_size,
        }


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each data-parallel rank sums its shard with its peers in the other groups)."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---- a replica group's state, as a live peer sends it ----


def local_state(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """Models' and optimizers' states with every DTensor as its local shard: a peer rank of
    another replica group holds the same shards."""
    return {
        "models": {k: _to_local(m.state_dict()) for k, m in models.items()},
        "optimizers": {k: _to_local(o.state_dict()) for k, o in optimizers.items()},
    }


@torch.no_grad()
def load_local_state(
    state: dict[str, Any], models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
) -> None:
    """`local_state`'s output back into the same models and optimizers (shards in place)."""
    for name, model in models.items():
        own = model.state_dict()
        for key, value in state["models"][name].items():
            _local(own[key]).copy_(value)
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(state["optimizers"][name])
        _as_params(optimizer)


def _to_local(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _as_params(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer states loaded as local shards become DTensors laid out as their parameters."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
                    optimizer.state[p][key] = DTensor.from_local(value, p.device_mesh, p.placements)

"""`[fault_tolerance]`: per-step fault tolerance across replica groups with TorchFT
(`titanrl/components/fault_tolerance.py`, docs/reliability.md). A docstring under every field."""

from dataclasses import dataclass


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one replica group of `group_size`: gradients are summed over the replica groups
    alive at each step (TorchFT's quorum), a dead group costs that step its share of the samples,
    and a restarted group heals from a live peer's state instead of a checkpoint. `titanrl run
    --ft-replicas N` sets the fields below and starts the lighthouse."""

    replica_id: int = 0
    """This replica group's index, 0 .. group_size - 1: it trains slice replica_id of every
    global batch (beside its data-parallel ranks), and replica group 0 writes the checkpoints."""

    group_size: int = 1
    """Replica groups of the job (the replicated dimension, dp_replicate across groups)."""

    min_replicas: int = 1
    """Replica groups a step needs: with fewer alive, the step waits for one to (re)join."""

    lighthouse: str = ""
    """The TorchFT lighthouse's address (http://host:port); empty: the TORCHFT_LIGHTHOUSE variable."""

    start_wait_s: float = 60.0
    """At the job's first step, how long a replica group waits for the others to join its quorum
    (started at about the same time, they begin in lockstep instead of one healing later)."""

    timeout_s: float = 30.0
    """Collectives across replica groups (gradients, commits, healing transfers) fail after this."""

    quorum_timeout_s: float = 60.0
    """A step's quorum must form within this (a restarted group joins within it)."""

    def validate(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"[fault_tolerance] group_size must be >= 1, got {self.group_size}")
        if not 0 <= self.replica_id < self.group_size:
            raise ValueError(
                f"[fault_tolerance] replica_id must be in 0 .. group_size - 1 = {self.group_size - 1}, "
                f"got {self.replica_id}"
            )
        if not 1 <= self.min_replicas <= self.group_size:
            raise ValueError(
                f"[fault_tolerance] min_replicas must be in 1 .. group_size = {self.group_size}, "
                f"got {self.min_replicas}"
            )
        if self.timeout_s <= 0 or self.quorum_timeout_s <= 0:
            raise ValueError("[fault_tolerance] timeout_s and quorum_timeout_s must be > 0")

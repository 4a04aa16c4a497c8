"""`[parallelism]`: how the ranks split the model and the batch (data, tensor, expert and
context parallelism). A docstring under every field; `validate()` checks them."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Parallelism:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer dimension): each replica holds a full copy, sharded by dp_shard."""

    dp_shard: int = -1
    """FSDP2 shard degree; -1 takes whatever the world size leaves after dp_replicate and tp."""

    tp: int = 1
    """Tensor-parallel degree (Megatron-style column/row sharding with sequence parallelism)."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 resharding: 'default' reshards every block but the root, 'always'/'never' force it."""

    ep: int = 1
    """Expert-parallel degree of mixture-of-experts models: each group of `ep` dp_shard ranks holds
    1/ep of the experts and exchanges tokens with all-to-all; FSDP2 shards the experts further over
    dp_shard / ep (TorchTitan's layout, no extra ranks). Must divide dp_shard and the expert count."""

    cp: int = 1
    """Context-parallel degree of the trainer: each sequence (packed row) is split into 2 x cp
    chunks, every cp rank holding a head and a tail chunk (causal load balance), attention
    all-gathers keys and values over cp. The cp ranks of a group see the same batch and join the
    FSDP2 group (it shards over dp_shard x cp, TorchTitan's layout). The generator is not
    context-parallel (docs/context_parallel.md)."""

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"[parallelism] {name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"[parallelism] dp_shard must be >= 1 or -1 (the rest), got {self.dp_shard}")

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanrl.config.parallelism import Parallelism


@dataclass
class ParallelDims:
    """Parallel degrees of a job and the `DeviceMesh` they define.

    The world mesh has the named dims ("dp_replicate", "dp_shard", "cp", "tp"), outermost first
    (with expert parallelism "dp_shard" = ("dp_shard_mod_ep", "ep") flattened); a degree of 1 is a
    size-1 dim. Expert parallelism borrows its ranks from dp_shard (TorchTitan's layout): the ep
    ranks of a group see different data and hold different experts. Views used by the code:
      - world_mesh["tp"]: tensor parallelism (and the generator's TP shards).
      - world_mesh["dp_shard"]: FSDP2 (or ("dp_replicate", "dp_shard") for HSDP).
      - world_mesh["ep"]: the experts' shards and the token all-to-all.
      - expert_fsdp_mesh: FSDP2 of the experts over what ep leaves of dp_shard (and dp_replicate).
      - dp_mesh: dp_replicate x dp_shard flattened: ranks that see different data.
      - world_mesh["cp"]: context parallelism; its ranks see the same batch, each a sequence
        shard (`titanrl.distributed.context_parallel`), and join the FSDP2 group: fsdp_mesh is
        ("dp_shard", "cp") flattened to "dp_shard_cp" (TorchTitan's layout).
    TP is innermost so that its frequent collectives stay within a node.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    cp: int = 1
    replica: int = 0
    """This replica group's index ([fault_tolerance]); its mesh is its own ranks'."""
    replicas: int = 1
    """Replica groups of the job: the data-parallel dimension across groups ([fault_tolerance])."""

    def __post_init__(self) -> None:
        # Each degree's own range is the [parallelism] section's rule (one place); here only how
        # the degrees fit the world size.
        Parallelism(
            dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, ep=self.ep, cp=self.cp
        ).validate()
        others = self.dp_replicate * self.cp * self.tp
        cp = f" x cp ({self.cp})" if self.cp > 1 else ""
        if self.dp_shard == -1:
            rest, remainder = divmod(self.world_size, others)
            if remainder or rest < 1:
                raise ValueError(
                    f"dp_replicate ({self.dp_replicate}){cp} x tp ({self.tp}) = {others} "
                    f"does not divide the world size {self.world_size}; change the degrees or the number of ranks"
                )
            self.dp_shard = rest
        product = self.dp_shard * others
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}){cp} x tp ({self.tp}) "
                f"= {product}, but the job runs on {self.world_size} ranks; set dp_shard = -1 or launch {product} ranks"
            )
        if self.cp > 1 and self.ep > 1:
            raise ValueError(
                f"[parallelism] cp = {self.cp} with ep = {self.ep}: context parallelism does not support expert "
                "parallelism yet; set cp = 1 or ep = 1"
            )
        if self.dp_shard % self.ep:
            raise ValueError(
                f"[parallelism] ep ({self.ep}) must divide dp_shard ({self.dp_shard}): expert parallelism "
                "shares the dp_shard ranks; choose an ep that divides it or launch more ranks"
            )

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def data_rank(self) -> int:
        """Which slice of every global batch this rank trains, over all replica groups."""
        return self.replica * self.dp_size + self.dp_rank

    @property
    def data_size(self) -> int:
        """Slices of every global batch: the data-parallel ranks of all replica groups."""
        return self.replicas * self.dp_size

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_size > 1 or self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The ranks that hold shards of the same sequences."""
        return self.world_mesh["cp"]

    @cached_property
    def world_mesh(self) -> DeviceMesh:
        """(dp_replicate, dp_shard, cp, tp); with expert parallelism dp_shard is split into
        (dp_shard_mod_ep, ep) and flattened back to `dp_shard`, so every view works either way.
        Without it no dim is flattened: slicing a flattened dim from the root mesh warns on every
        rank (torch 2.13), and a user error must stay one line. With context parallelism
        ("dp_shard", "cp") is flattened to "dp_shard_cp", FSDP2's mesh (`dp_shard_cp_mesh`)."""
        if not self.ep_enabled:
            mesh = init_device_mesh(
                device_type(),
                (self.dp_replicate, self.dp_shard, self.cp, self.tp),
                mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
            )
            return mesh
        mesh = init_device_mesh(
            device_type(),
            (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp),
            mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp"),
        )
        mesh["dp_shard_mod_ep", "ep"]._flatten(mesh_dim_name="dp_shard")
        return mesh

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh of ep-sharded experts: dp_shard / ep, or 2-D with dp_replicate (HSDP)."""
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_mod_ep"]
        return self.world_mesh["dp_shard_mod_ep"]

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """dp_replicate x dp_shard flattened: the ranks that see different data."""
        return self.world_mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")

    @cached_property
    def dp_shard_cp_mesh(self) -> DeviceMesh:
        """dp_shard x cp flattened (kept, not sliced again from the root: that warns)."""
        return self.world_mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2 mesh: 1-D over dp_shard (x cp), or 2-D (replicate, shard) for HSDP."""
        if self.cp_enabled:
            shard_mesh = self.dp_shard_cp_mesh
            return self.world_mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else shard_mesh
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard"]
        return self.world_mesh["dp_shard"]

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data shard (ranks of one TP group share it)."""
        if self.world_size == 1:
            return 0
        return self.dp_mesh.get_local_rank()


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

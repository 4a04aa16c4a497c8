"""Expert parallelism: the experts of an MoE layer sharded over the `ep` mesh dim, tokens moved
to their experts' rank and back with all-to-all (TorchTitan's `ExpertParallel`).

`MoE.routed` sorts its (token, slot) rows by expert and calls `GroupedExperts(x_SD, counts_E)`;
this style wraps that call. Before it (dispatch): every rank sends each peer the rows of the
peer's experts (E / ep consecutive experts per rank), receives the rows of its own experts from
every peer, and regroups them by local expert. After it (combine): the inverse regrouping and
all-to-all, so `MoE.routed` gets its rows back in its own order. Both all-to-alls are
differentiable (the backward of one is the other with the splits swapped), so the experts'
gradients hold the contributions of every rank's tokens: FSDP2 then only sums over the ranks
that hold the same experts (`ParallelDims.expert_fsdp_mesh`).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def all_to_all(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all with variable splits: rows `in_splits[r]` go to rank r."""
    out = funcol.all_to_all_single_autograd(x_SD.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(out)


def regroup_index(counts_RL: torch.Tensor) -> torch.Tensor:
    """Rows arrive source-major, blocks (r, l) of `counts_RL[r, l]` rows; the index that puts them
    expert-major, (l, r), which the grouped experts need (one contiguous slice per expert)."""
    sizes_S = counts_RL.flatten()
    starts_RL = (torch.cumsum(sizes_S, 0) - sizes_S).view(counts_RL.shape)
    sizes_LR, starts_LR = counts_RL.t().flatten(), starts_RL.t().flatten()
    new_starts_LR = torch.cumsum(sizes_LR, 0) - sizes_LR
    offset_N = torch.repeat_interleave(starts_LR - new_starts_LR, sizes_LR)
    return offset_N + torch.arange(offset_N.numel(), device=offset_N.device)


class ExpertParallel(ParallelStyle):
    """Shard a `GroupedExperts`' w1 / w2 / w3 on dim 0 (experts) over a 1-D mesh and wrap its
    forward in token dispatch / combine. One instance per module: it keeps the splits of the
    forward in flight (a recomputed forward under activation checkpointing sets the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_splits: list[int] = []
        self.out_splits: list[int] = []
        self.index_N: torch.Tensor | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch's stub has input_fn / output_fn return None; they return the new inputs / outputs.
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_experts,
            input_fn=self._dispatch,  # type: ignore[arg-type]
            output_fn=self._combine,  # type: ignore[arg-type]
        )

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
        x_SD, counts_E = inputs
        ep = mesh.size()
        assert counts_E.numel() % ep == 0, (counts_E.numel(), ep)
        group = mesh.get_group()
        with torch.no_grad():
            recv_E = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_E, counts_E.contiguous(), group=group)
            recv_RL = recv_E.view(ep, -1)
            self.in_splits = counts_E.view(ep, -1).sum(1).tolist()
            self.out_splits = recv_RL.sum(1).tolist()
            self.index_N = regroup_index(recv_RL)
        x_ND = all_to_all(x_SD, self.out_splits, self.in_splits, group)
        return x_ND[self.index_N], recv_RL.sum(0)

    def _combine(self, module: nn.Module, y_ND: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        index_N = self.index_N
        assert index_N is not None, "set by the forward's dispatch"
        inverse_N = torch.empty_like(index_N)
        inverse_N[index_N] = torch.arange(index_N.numel(), device=index_N.device)
        return all_to_all(y_ND[inverse_N], self.in_splits, self.out_splits, mesh.get_group())


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)

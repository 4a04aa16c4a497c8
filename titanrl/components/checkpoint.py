"""Sharded, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout under `<dump_folder>/<checkpoint.folder>/`:
    step-<N>/            a complete checkpoint: DCP shards + .metadata, and host state per rank
    .tmp-step-<N>/       a save in progress (never loaded; removed by the next save)
A save writes into the temporary folder on every rank, then rank 0 renames it once all ranks
have finished: a crash mid-save leaves the previous `step-*` as the latest. Loading resharding
is DCP's: a checkpoint saved on 2 ranks loads on 1 or 4.
"""

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"step-(\d+)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, folder: str, keep_latest_k: int) -> None:
        self.folder = folder
        self.keep_latest_k = keep_latest_k

    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def complete_steps(self) -> list[int]:
        """Steps with a finished checkpoint (renamed, with DCP's .metadata), oldest first."""
        if not os.path.isdir(self.folder):
            return []
        steps = []
        for name in os.listdir(self.folder):
            m = _STEP_DIR.fullmatch(name)
            if m and os.path.exists(os.path.join(self.folder, name, ".metadata")):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def save(
        self, step: int, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer],
        host_state: dict[str, Any],
    ) -> str:
        """Collective. `optimizers` maps a model's name in `models` to its optimizer; `host_state`
        (data loader, RNG, counters) is saved per rank with torch.save."""
        for name, model in models.items():
            _check_finite(name, model)
        tmp = os.path.join(self.folder, f".tmp-step-{step}")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
        _barrier()
        dcp.save(_state(models, optimizers), checkpoint_id=tmp)
        torch.save(host_state, os.path.join(tmp, f"host_rank{_rank()}.pt"))
        fault_point("checkpoint_save", step)
        _barrier()
        final = self.step_dir(step)
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            self._purge()
        _barrier()
        return final

    def _purge(self) -> None:
        for name in os.listdir(self.folder):
            if name.startswith(".tmp-step-"):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in self.complete_steps()[: -self.keep_latest_k]:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def load_latest(
        self, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], log=print
    ) -> tuple[int, dict[str, Any]] | None:
        """Load the newest checkpoint that loads; a damaged one is reported and skipped."""
        for step in reversed(self.complete_steps()):
            try:
                return step, self.load(self.step_dir(step), models, optimizers)
            # A truncated or corrupted checkpoint: fall back to an older one. (DCP wraps read
            # errors in CheckpointException, a BaseException.)
            except (Exception, CheckpointException) as e:
                log(f"checkpoint {self.step_dir(step)} cannot be loaded ({type(e).__name__}: {e}); "
                    "trying the previous one")
        return None

    def load(
        self, path: str, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
    ) -> dict[str, Any]:
        state = _state(models, optimizers)
        dcp.load(state, checkpoint_id=path)
        for name, model in models.items():
            set_model_state_dict(model, state[name])
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(models[name], optimizer, state[_optimizer_key(name)])
        # Host state is the same on every rank of a job (all ranks walk the same global data
        # stream), so rank 0's file serves any new world size.
        host_file = os.path.join(path, f"host_rank{_rank()}.pt")
        if not os.path.exists(host_file):
            host_file = os.path.join(path, "host_rank0.pt")
        return torch.load(host_file, weights_only=False)


def _optimizer_key(model_name: str) -> str:
    return "optimizer" if model_name == "model" else f"optimizer_{model_name}"


def _state(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {name: get_model_state_dict(model) for name, model in models.items()}
    for name, optimizer in optimizers.items():
        state[_optimizer_key(name)] = get_optimizer_state_dict(models[name], optimizer)
    return state


def _check_finite(name: str, model: nn.Module) -> None:
    """Never write a NaN model: every rank checks its shards, all agree."""
    bad = torch.tensor(0.0)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local.detach()).all():
            bad += 1
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item():
        raise FloatingPointError(f"refusing to checkpoint '{name}': it has non-finite parameters")


def fault_active(where: str, step: int) -> bool:
    """Fault-injection hook for tests: TITANRL_FAULT='<where>:<step>:<rank>' names one place."""
    spec = os.environ.get("TITANRL_FAULT")
    if not spec:
        return False
    target_where, target_step, target_rank = spec.split(":")
    return where == target_where and step == int(target_step) and _rank() == int(target_rank)


def fault_point(where: str, step: int) -> None:
    """SIGKILL this rank here if TITANRL_FAULT names this place (kill -9 tests)."""
    if fault_active(where, step):
        os.kill(os.getpid(), 9)

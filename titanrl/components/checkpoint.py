"""Sharded, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout under `<dump_folder>/<checkpoint.folder>/`:
    step-<N>/            a complete checkpoint: DCP shards + .metadata, and host state per rank
    .tmp-step-<N>/       a save in progress (never loaded; removed by the next save)
A save writes into the temporary folder on every rank, then rank 0 renames it once all ranks
have finished: a crash mid-save leaves the previous `step-*` as the latest. Loading reshards
with DCP: a checkpoint saved on 1 rank loads on 2 (FSDP or TP) or 4, and one saved on 2 on 1.

With `async_mode = "async"` the save copies the state to host memory and returns; a background
thread writes it (over a gloo group of its own, so that its collectives never interleave with
training's) and rank 0 renames the folder when the write has finished. `wait()` (the next save,
the end of the run) raises a failed write's error on every rank.

A save that cannot write (disk full, no permission) raises `CheckpointSaveError` on every rank,
naming the folder and the cause, and removes its temporary folder; no `step-N` appears.
"""

import errno
import gc
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanrl.components.faults import fault_point
from titanrl.models.lora import has_lora, is_lora_key

_STEP_DIR = re.compile(r"step-(\d+)")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete checkpoint is still the latest."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, folder: str, keep_latest_k: int, async_mode: Literal["disabled", "async"] = "disabled") -> None:
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', got {async_mode!r}")
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        # (step, temporary folder, done when written and renamed) of the last async save, if any.
        self._pending: tuple[int, str, Future] | None = None
        self._async_group: dist.ProcessGroup | None = None

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
        self,
        step: int,
        models: dict[str, nn.Module],
        optimizers: dict[str, torch.optim.Optimizer],
        host_state: dict[str, Any],
    ) -> str:
        """Collective. `optimizers` maps a model's name in `models` to its optimizer; `host_state`
        (data loader, RNG, counters) is saved per rank with torch.save. Returns the step-N folder;
        an async save renames its folder to it as soon as the write has finished."""
        self.wait()
        for name, model in models.items():
            _check_finite(name, model)
        tmp = os.path.join(self.folder, f".tmp-step-{step}")
        error = None
        if _rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            except OSError as e:
                error = e
        self._agree(step, tmp, error)
        # Host state first: when an async write has finished, the whole checkpoint is on disk.
        error = None
        try:
            torch.save(host_state, os.path.join(tmp, f"host_rank{_rank()}.pt"))
        except OSError as e:
            error = e
        self._agree(step, tmp, error)
        state = _state(models, optimizers)
        error = None
        try:
            if self.async_mode == "async":
                written = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group())
                self._pending = (step, tmp, self._publish_when_written(step, tmp, written))
            else:
                dcp.save(state, checkpoint_id=tmp)
        # DCP raises a rank's write error on every rank, wrapped in a CheckpointException (a
        # BaseException).
        except (Exception, CheckpointException) as e:
            error = e
        self._agree(step, tmp, error)
        if self.async_mode != "async":
            self._publish(step, tmp)
        return self.step_dir(step)

    def wait(self) -> None:
        """Collective: wait for the async save in flight, if any, to be written and renamed to
        step-N, and raise its error on every rank. The trainer calls it at the end of the run;
        `save` calls it before starting another."""
        if self._pending is None:
            return
        step, tmp, published = self._pending
        self._pending = None
        error = None
        try:
            published.result()
        except (Exception, CheckpointException) as e:
            error = e
        self._agree(step, tmp, error)

    def close(self) -> None:
        """Destroy the async writer's group, once no save is in flight (`wait` first), before
        the default group is. After a failed async save, reference cycles (the error's traceback
        frames, DCP's `_DistWrapper`) keep the group alive until a garbage collection, which
        could be the one at interpreter exit: its gloo threads were then torn down in whatever
        order finalisation picked, and a rank aborted ("terminate called without an active
        exception", CI). Collected here, while the process is whole. With a save still in
        flight (a failing run), the group is left to its writer thread."""
        if self._async_group is not None and self._pending is None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None
            gc.collect()

    def _group(self) -> dist.ProcessGroup | None:
        """The async writer's own gloo group (created once, collectively): DCP's collectives run
        in its background thread, and on the training group they could interleave with the
        training thread's own collectives in a different order on different ranks."""
        if dist.is_initialized() and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _publish_when_written(self, step: int, tmp: str, written: Future) -> Future:
        """A future that is done once the async write is and rank 0 has renamed the folder. Rank 0
        renames it without asking the other ranks: its DCP save ends after every rank's shards are
        written (DCP gathers their write results before writing .metadata), and host state was
        written before the save began. So a crash after the write loses nothing, and one before
        it leaves only the temporary folder."""
        published: Future = Future()

        def publish(_: Future) -> None:
            try:
                written.result()
                fault_point("checkpoint_save", step)
                if _rank() == 0:
                    self._rename(step, tmp)
                published.set_result(None)
            except BaseException as e:
                published.set_exception(e)

        written.add_done_callback(publish)  # runs in DCP's writer thread (or here, if already done)
        return published

    def _publish(self, step: int, tmp: str) -> None:
        fault_point("checkpoint_save", step)
        _barrier()
        error = None
        if _rank() == 0:
            try:
                self._rename(step, tmp)
            except OSError as e:
                error = e
        self._agree(step, tmp, error)

    def _rename(self, step: int, tmp: str) -> None:
        shutil.rmtree(self.step_dir(step), ignore_errors=True)
        os.rename(tmp, self.step_dir(step))
        self._purge()

    def _agree(self, step: int, tmp: str, error: BaseException | None) -> None:
        """Collective: raise on every rank if this rank's part of the save (`error`) or any other
        rank's failed, so that no rank waits in a barrier for a rank that gave up."""
        failed = torch.zeros(dist.get_world_size() if dist.is_initialized() else 1)
        failed[_rank()] = float(error is not None)
        if dist.is_initialized():
            dist.all_reduce(failed)
        if failed.any():
            ranks = failed.nonzero().flatten().tolist()
            self._fail(
                step,
                tmp,
                error or RuntimeError(f"rank(s) {ranks} failed to write their part (their own error names the cause)"),
            )

    def _fail(self, step: int, tmp: str, error: BaseException):
        """Every rank: drop the partial save (it would only fill the disk) and raise the cause."""
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        message = _save_error(self.folder, step, error, self.complete_steps())
        # A disk-full or permission error says all in its message; anything else keeps its traceback.
        raise message from (None if _os_error(error) is not None else error)

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
                log(
                    f"checkpoint {self.step_dir(step)} cannot be loaded ({type(e).__name__}: {e}); "
                    "trying the previous one"
                )
        return None

    def load(
        self, path: str, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]
    ) -> dict[str, Any]:
        state = _state(models, optimizers)
        dcp.load(state, checkpoint_id=path)
        for name, model in models.items():
            set_model_state_dict(model, state[name], options=_model_options(model))
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(models[name], optimizer, state[_optimizer_key(name)])
        # Host state is the same on every rank of a job: all ranks walk the same global data
        # stream (each keeps its strided share of a batch, so the loader's position does not
        # depend on the rank or the world size) and sampling RNGs are seeded per sample. So
        # rank 0's file serves a rank that did not exist when the checkpoint was saved.
        host_file = os.path.join(path, f"host_rank{_rank()}.pt")
        if not os.path.exists(host_file):
            host_file = os.path.join(path, "host_rank0.pt")
        return torch.load(host_file, weights_only=False)


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, its cause, or one a rank reported to DCP."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        for exc, _ in error.failures.values():
            found = _os_error(exc)
            if found is not None:
                return found
    cause = error.__cause__ or error.__context__
    return _os_error(cause) if cause is not None else None


def _free_bytes(folder: str) -> int | None:
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _save_error(folder: str, step: int, error: BaseException, complete: list[int]) -> CheckpointSaveError:
    """The message a user acts on: which folder, why, what to do, and what is still there."""
    os_error = _os_error(error)
    where = f"cannot write the step {step} checkpoint to '{folder}'"
    latest = f"step-{complete[-1]} is still the latest checkpoint" if complete else "no checkpoint was saved yet"
    if os_error is not None and os_error.errno in _DISK_FULL:
        free = _free_bytes(folder)
        free_text = f", {free / 2**30:.2f} GiB free now" if free is not None else ""
        return CheckpointSaveError(
            f"{where}: no free space left on the device ({os_error.strerror}{free_text}); free disk space or "
            f"lower checkpoint.keep_latest_k, or point job.dump_folder at a larger disk ({latest})"
        )
    if os_error is not None and os_error.errno in _NO_PERMISSION:
        return CheckpointSaveError(
            f"{where}: permission denied or read-only file system ({os_error.strerror}); make the folder "
            f"writable for this user or point job.dump_folder / checkpoint.folder elsewhere ({latest})"
        )
    cause = os_error if os_error is not None else error
    return CheckpointSaveError(f"{where}: {type(cause).__name__}: {cause} ({latest})")


def _optimizer_key(model_name: str) -> str:
    return "optimizer" if model_name == "model" else f"optimizer_{model_name}"


def _model_options(model: nn.Module) -> StateDictOptions:
    """A LoRA model checkpoints its adapters only: the frozen base is rebuilt from its source
    (model.hf_checkpoint or the seeded init) on resume."""
    lora = has_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _model_state(model: nn.Module) -> dict[str, Any]:
    sd = get_model_state_dict(model, options=_model_options(model))
    if has_lora(model):
        # ignore_frozen_params keeps a tied output head (not among named_parameters): drop it too.
        sd = {k: v for k, v in sd.items() if is_lora_key(k)}
    return sd


def _state(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {name: _model_state(model) for name, model in models.items()}
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

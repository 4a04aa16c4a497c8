"""Sharded, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Layout under `<dump_folder>/<checkpoint.folder>/` (`checkpoint_folder.py`):
    step-<N>/            a complete checkpoint: DCP shards + .metadata, and host state per rank
    .tmp-step-<N>/       a save in progress (never loaded; removed by the next save)
A save writes into the temporary folder on every rank, then rank 0 renames it once all ranks
have finished: a crash mid-save leaves the previous `step-*` as the latest. Loading reshards
with DCP: a checkpoint saved on 1 rank loads on 2 (FSDP or TP) or 4, and one saved on 2 on 1.

With `async_mode = "async"` the save copies the state to host memory and returns; a background
thread writes it (over a gloo group of its own, so that its collectives never interleave with
training's) and rank 0 renames the folder when the write has finished (`checkpoint_async.py`).
`wait()` (the next save, the end of the run) raises a failed write's error on every rank.

Before the rename, the ranks checksum what they wrote into `checksums.json`; a load checks the
files against it first and reads host state as plain data (`checkpoint_integrity.py`).
`load_latest` skips a checkpoint that fails either check, or fails to load, with one line (its
traceback goes to `checkpoint_errors.log` beside the checkpoint folder) and loads the previous
one; when none loads, it raises `CheckpointCorrupt` rather than let the run start afresh.

A save that cannot write (disk full, no permission) raises `CheckpointSaveError` on every rank,
naming the folder and the cause, and removes its temporary folder; no `step-N` appears.
"""

import os
import shutil
import traceback
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanrl.components.checkpoint_async import AsyncCheckpointWriter
from titanrl.components.checkpoint_errors import CheckpointSaveError, free_bytes, nbytes, save_error
from titanrl.components.checkpoint_folder import CheckpointFolder, rank
from titanrl.components.checkpoint_integrity import (
    MANIFEST,
    CheckpointCorrupt,
    check_files,
    corrupt,
    load_host_state,
    read_manifest,
    summary,
    verify_checkpoint,
)
from titanrl.components.faults import fault_point
from titanrl.models.lora import has_lora, is_lora_key

# verify_checkpoint: the launcher's pre-flight; the errors: what callers catch.
__all__ = ["CheckpointCorrupt", "CheckpointManager", "CheckpointSaveError", "verify_checkpoint"]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(
        self,
        folder: str,
        keep_latest_k: int,
        async_mode: Literal["disabled", "async"] = "disabled",
        error_log: str = "",
    ) -> None:
        """`error_log`: where the tracebacks of skipped checkpoints go (default: checkpoint_errors.log
        beside `folder`)."""
        if async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', got {async_mode!r}")
        self.folder = folder
        self.error_log = error_log or os.path.join(os.path.dirname(os.path.abspath(folder)), "checkpoint_errors.log")
        # Bytes this rank's part of the save in progress holds, for the disk-full message.
        self._needed = 0
        self.layout = CheckpointFolder(folder, keep_latest_k)
        self.async_mode = async_mode
        self.writer = AsyncCheckpointWriter(self.layout)

    def step_dir(self, step: int) -> str:
        return self.layout.step_dir(step)

    def complete_steps(self) -> list[int]:
        """Steps with a finished checkpoint (renamed, with DCP's .metadata), oldest first."""
        return self.layout.complete_steps()

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
        tmp = self.layout.tmp_dir(step)
        error: BaseException | None = None
        if rank() == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp, exist_ok=True)
            except OSError as e:
                error = e
        self._agree(step, tmp, error)
        # Host state first: when an async write has finished, the whole checkpoint is on disk.
        state = _state(models, optimizers)
        self._needed = nbytes(state) + nbytes(host_state)
        error = None
        try:
            torch.save(host_state, os.path.join(tmp, f"host_rank{rank()}.pt"))
        # Writing to a path, torch's zip writer reports a full disk as a RuntimeError.
        except Exception as e:
            error = e
        self._agree(step, tmp, error)
        error = None
        try:
            if self.async_mode == "async":
                self.writer.start(step, tmp, state)
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
        pending = self.writer.take_pending()
        if pending is None:
            return
        step, tmp, published = pending
        error: BaseException | None = None
        try:
            published.result()
        except (Exception, CheckpointException) as e:
            error = e
        self._agree(step, tmp, error)

    def close(self) -> None:
        """Destroy the async writer's group, once no save is in flight (`wait` first), before
        the default group is (`AsyncCheckpointWriter.close`)."""
        self.writer.close()

    def _publish(self, step: int, tmp: str) -> None:
        fault_point("checkpoint_save", step)
        error = None
        try:
            self.layout.publish(step, tmp, None)
        except Exception as e:
            error = e
        self._agree(step, tmp, error)

    def _agree(self, step: int, tmp: str, error: BaseException | None) -> None:
        """Collective: raise on every rank if this rank's part of the save (`error`) or any other
        rank's failed, so that no rank waits in a barrier for a rank that gave up."""
        failed = torch.zeros(dist.get_world_size() if dist.is_initialized() else 1)
        failed[rank()] = float(error is not None)
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
        free = free_bytes(self.folder)  # before the partial save is removed, which frees space
        _barrier()
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        message, says_all = save_error(self.folder, step, error, self.complete_steps(), free, self._needed)
        # A disk-full or permission error says all in its message; anything else keeps its traceback.
        raise message from (None if says_all else error)

    def load_latest(
        self, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], log=print
    ) -> tuple[int, dict[str, Any]] | None:
        """Collective. Load the newest checkpoint that loads; a damaged one is skipped with one
        line (`log`). None when there is no checkpoint; `CheckpointCorrupt` when none loads."""
        reasons = []
        for step in reversed(self.complete_steps()):
            path = self.step_dir(step)
            try:
                return step, self.load(path, models, optimizers, log)
            # Corrupt, truncated, refused or of another model: fall back to an older one. (DCP
            # wraps read errors in CheckpointException, a BaseException.)
            except (Exception, CheckpointException) as e:
                reason = str(e) if isinstance(e, CheckpointCorrupt) else _cannot_load(path, e)
                reasons.append(reason)
                self._log_error(path, e)
                log(f"{reason}; skipped it (traceback in {self.error_log})")
        if reasons:
            raise CheckpointCorrupt(
                f"no checkpoint in {self.folder} can be loaded ({'; '.join(reasons)}); set checkpoint.load_path to "
                f"an intact step-N folder, or move {self.folder} away to start a fresh run"
            )
        return None

    def load(
        self, path: str, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer], log=print
    ) -> dict[str, Any]:
        """Collective. Check the checkpoint's files, read its host state as plain data (raising
        `CheckpointCorrupt` on every rank if either fails), then load it; returns the host state."""
        host_file = self._verify(path, log)
        host = self._host_state(path, host_file)
        optimizers = _with_saved_state(path, optimizers)
        state = _state(models, optimizers)
        dcp.load(state, checkpoint_id=path)
        for name, model in models.items():
            set_model_state_dict(model, state[name], options=_model_options(model))
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(models[name], optimizer, state[_optimizer_key(name)])
        return host

    def _verify(self, path: str, log) -> str:
        """Collective: check the files against the manifest, shared out over the ranks; returns
        the host-state file this rank reads. Host state is the same on every rank of a job: all
        ranks walk the same global data stream (each keeps its strided share of a batch, so the
        loader's position does not depend on the rank or the world size) and sampling RNGs are
        seeded per sample. So rank 0's file serves a rank that did not exist at save time."""
        files = read_manifest(path)
        if files is None:
            log(f"checkpoint {path} has no {MANIFEST} (written before checkpoints had checksums): loaded unchecked")
            files = {name: {} for name in os.listdir(path)}
        else:
            world = dist.get_world_size() if dist.is_initialized() else 1
            problem = _first_problem(check_files(files, path, sorted(files)[rank() :: world]))
            if problem is not None:
                raise corrupt(path, problem)
        own = f"host_rank{rank()}.pt"
        return os.path.join(path, own if own in files else "host_rank0.pt")

    def _host_state(self, path: str, host_file: str) -> dict[str, Any]:
        """Collective: this rank's host state, or `CheckpointCorrupt` on every rank if any rank's
        file is refused or unreadable."""
        host, error, problem = None, None, None
        try:
            host = load_host_state(host_file)
        except Exception as e:
            error = e
            problem = str(e) if isinstance(e, CheckpointCorrupt) else _cannot_load(path, e)
        problem = _first_problem(problem)
        if problem is not None:
            raise CheckpointCorrupt(problem) from error
        assert host is not None, "no rank's problem, yet no host state"
        return host

    def _log_error(self, path: str, error: BaseException) -> None:
        """Rank 0: the traceback of a skipped checkpoint, appended to the error log."""
        if rank() != 0:
            return
        try:
            with open(self.error_log, "a") as f:
                f.write(f"checkpoint {path} skipped:\n{''.join(traceback.format_exception(error))}\n")
        except OSError:
            pass  # the notice on the console still names the cause


def _cannot_load(path: str, error: BaseException) -> str:
    return f"checkpoint {path} cannot be loaded ({summary(error)})"


def _first_problem(problem: str | None) -> str | None:
    """Collective: the first rank's problem (rank order), so that every rank takes the same branch."""
    if not dist.is_initialized():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


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


def _with_saved_state(path: str, optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, torch.optim.Optimizer]:
    """The optimizers whose state the checkpoint holds. One saved before its first step (PPO's
    policy while the critic warms up: gradients, no step) has none; it stays fresh here too, as
    it was then. (Asking DCP for its state dict would initialise it, and the load would look
    for state the checkpoint never had.)"""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    prefixes = {f"{_optimizer_key(name)}.state." for name in optimizers}
    found = {prefix for key in saved for prefix in prefixes if key.startswith(prefix)}
    return {name: opt for name, opt in optimizers.items() if f"{_optimizer_key(name)}.state." in found}


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

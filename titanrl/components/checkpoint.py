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

Before the rename, the ranks checksum what they wrote into `checksums.json`; a load checks the
files against it first and reads host state as plain data (`checkpoint_integrity.py`).
`load_latest` skips a checkpoint that fails either check, or fails to load, with one line (its
traceback goes to `checkpoint_errors.log` beside the checkpoint folder) and loads the previous
one; when none loads, it raises `CheckpointCorrupt` rather than let the run start afresh.

A save that cannot write (disk full, no permission) raises `CheckpointSaveError` on every rank,
naming the folder and the cause, and removes its temporary folder; no `step-N` appears.
"""

import gc
import os
import re
import shutil
import traceback
from concurrent.futures import Future
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

from titanrl.components.checkpoint_errors import CheckpointSaveError, free_bytes, nbytes, save_error
from titanrl.components.checkpoint_integrity import (
    MANIFEST,
    CheckpointCorrupt,
    check_files,
    checksums,
    corrupt,
    load_host_state,
    rank_files,
    read_manifest,
    summary,
    verify_checkpoint,
    write_manifest,
)
from titanrl.components.faults import fault_point
from titanrl.models.lora import has_lora, is_lora_key

# verify_checkpoint: the launcher's pre-flight; the errors: what callers catch.
__all__ = ["CheckpointCorrupt", "CheckpointManager", "CheckpointSaveError", "verify_checkpoint"]

_STEP_DIR = re.compile(r"step-(\d+)")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
        state = _state(models, optimizers)
        self._needed = nbytes(state) + nbytes(host_state)
        error = None
        try:
            torch.save(host_state, os.path.join(tmp, f"host_rank{_rank()}.pt"))
        # Writing to a path, torch's zip writer reports a full disk as a RuntimeError.
        except Exception as e:
            error = e
        self._agree(step, tmp, error)
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
                self._seal(tmp, self._async_group)
                if _rank() == 0:
                    self._rename(step, tmp)
                published.set_result(None)
            except BaseException as e:
                published.set_exception(e)

        written.add_done_callback(publish)  # runs in DCP's writer thread (or here, if already done)
        return published

    def _publish(self, step: int, tmp: str) -> None:
        fault_point("checkpoint_save", step)
        error = None
        try:
            self._seal(tmp, None)
            if _rank() == 0:
                self._rename(step, tmp)
        except Exception as e:
            error = e
        self._agree(step, tmp, error)

    def _seal(self, tmp: str, group: dist.ProcessGroup | None) -> None:
        """Collective over `group` (after every rank's files are written): each rank checksums the
        files it wrote, rank 0 gathers them and writes the manifest. A rank that cannot read its
        files back still takes part, so that no rank waits for it."""
        try:
            own, error = checksums(tmp, rank_files(tmp, _rank())), None
        except OSError as e:
            own, error = None, e
        claimed = [own]
        if dist.is_initialized():
            claimed = [None] * dist.get_world_size(group)
            dist.all_gather_object(claimed, own, group=group)
        if error is not None:
            raise error
        if _rank() == 0:
            failed = [r for r, files in enumerate(claimed) if files is None]
            if failed:
                raise RuntimeError(f"rank(s) {failed} could not read back the files they wrote")
            write_manifest(tmp, {name: c for files in claimed for name, c in files.items()})

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
        free = free_bytes(self.folder)  # before the partial save is removed, which frees space
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        message, says_all = save_error(self.folder, step, error, self.complete_steps(), free, self._needed)
        # A disk-full or permission error says all in its message; anything else keeps its traceback.
        raise message from (None if says_all else error)

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
            problem = _first_problem(check_files(files, path, sorted(files)[_rank() :: world]))
            if problem is not None:
                raise corrupt(path, problem)
        own = f"host_rank{_rank()}.pt"
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
        return host

    def _log_error(self, path: str, error: BaseException) -> None:
        """Rank 0: the traceback of a skipped checkpoint, appended to the error log."""
        if _rank() != 0:
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

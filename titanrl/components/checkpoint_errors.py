"""Why a checkpoint save failed, in the words a user acts on (disk full, no permission, other)."""

import errno
import os
import shutil
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from titanrl.components.checkpoint_integrity import summary

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_NO_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous complete checkpoint is still the latest."""


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, its cause, or one a rank reported to DCP."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        for exc, _ in error.failures.values():
            found = os_error(exc)
            if found is not None:
                return found
    cause = error.__cause__ or error.__context__
    return os_error(cause) if cause is not None else None


def free_bytes(folder: str) -> int | None:
    """Free bytes on the file system of `folder` (statvfs), or None if it cannot be asked."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def nbytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict on this rank: its shards, for a DTensor."""
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _out_of_space(cause: OSError | None, free: int | None, needed: int) -> bool:
    """ENOSPC / EDQUOT anywhere in the error's chain; or, when there is no OSError (torch's zip
    writer reports a short write as `RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos`), less space free on the folder's file system than this rank's part needs."""
    if cause is not None:
        return cause.errno in _DISK_FULL
    return free is not None and free < needed


def save_error(
    folder: str, step: int, error: BaseException, complete: list[int], free: int | None = None, needed: int = 0
) -> tuple[CheckpointSaveError, bool]:
    """The message a user acts on: which folder, why, what to do, and what is still there; and
    whether it says all (else the cause's traceback stays attached). `free`: bytes free on the
    folder's file system when the save failed; `needed`: bytes of this rank's part."""
    cause = os_error(error)
    where = f"cannot write the step {step} checkpoint to '{folder}'"
    latest = f"step-{complete[-1]} is still the latest checkpoint" if complete else "no checkpoint was saved yet"
    if _out_of_space(cause, free, needed):
        space = (
            f"{free / 2**20:.1f} MiB free there, this rank writes {needed / 2**20:.1f} MiB" if free is not None else ""
        )
        why = cause.strerror if cause is not None else f"the writer failed with {summary(error)}"
        detail = "; ".join(filter(None, [why, space]))
        return CheckpointSaveError(
            f"{where}: no free space left on the device (no space left on device: {detail}); "
            f"free disk space or lower checkpoint.keep_latest_k, or point job.dump_folder at a larger disk ({latest})"
        ), True
    if cause is not None and cause.errno in _NO_PERMISSION:
        return CheckpointSaveError(
            f"{where}: permission denied or read-only file system ({cause.strerror}); make the folder "
            f"writable for this user or point job.dump_folder / checkpoint.folder elsewhere ({latest})"
        ), True
    shown = cause if cause is not None else error
    return CheckpointSaveError(f"{where}: {type(shown).__name__}: {shown} ({latest})"), cause is not None

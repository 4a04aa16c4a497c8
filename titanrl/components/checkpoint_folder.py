"""The checkpoint folder: where each save goes, which checkpoints are complete, which are kept.

Layout under `<dump_folder>/<checkpoint.folder>/`:
    step-<N>/            a complete checkpoint: DCP shards + .metadata, and host state per rank
    .tmp-step-<N>/       a save in progress (never loaded; removed by the next save)
A save is published once every rank has written its part: the ranks checksum their files into
the manifest, then rank 0 renames the temporary folder to step-<N> and removes older ones.
"""

import os
import re
import shutil
from typing import Any

import torch.distributed as dist

from titanrl.components.checkpoint_integrity import checksums, rank_files, write_manifest

_STEP_DIR = re.compile(r"step-(\d+)")


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


class CheckpointFolder:
    """The checkpoints under `path`; publishing one keeps the newest `keep_latest_k` (0: all)."""

    def __init__(self, path: str, keep_latest_k: int) -> None:
        self.path = path
        self.keep_latest_k = keep_latest_k

    def step_dir(self, step: int) -> str:
        return os.path.join(self.path, f"step-{step}")

    def tmp_dir(self, step: int) -> str:
        return os.path.join(self.path, f".tmp-step-{step}")

    def complete_steps(self) -> list[int]:
        """Steps with a finished checkpoint (renamed, with DCP's .metadata), oldest first."""
        if not os.path.isdir(self.path):
            return []
        steps = []
        for name in os.listdir(self.path):
            m = _STEP_DIR.fullmatch(name)
            if m and os.path.exists(os.path.join(self.path, name, ".metadata")):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def publish(self, step: int, tmp: str, group: dist.ProcessGroup | None) -> None:
        """Collective over `group`, once every rank's files in `tmp` are written: seal them
        (`seal`), then rank 0 makes `tmp` the step's checkpoint and drops those not kept."""
        seal(tmp, group)
        if rank() == 0:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
            os.rename(tmp, self.step_dir(step))
            self._purge()

    def _purge(self) -> None:
        for name in os.listdir(self.path):
            if name.startswith(".tmp-step-"):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in self.complete_steps()[: -self.keep_latest_k]:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)


def seal(tmp: str, group: dist.ProcessGroup | None) -> None:
    """Collective over `group` (after every rank's files are written): each rank checksums the
    files it wrote, rank 0 gathers them and writes the manifest. A rank that cannot read its
    files back still takes part, so that no rank waits for it."""
    own: dict[str, dict[str, Any]] | None = None
    error: OSError | None = None
    try:
        own = checksums(tmp, rank_files(tmp, rank()))
    except OSError as e:
        error = e
    claimed: list[dict[str, dict[str, Any]] | None] = [own]
    if dist.is_initialized():
        claimed = [None] * dist.get_world_size(group)
        dist.all_gather_object(claimed, own, group=group)
    if error is not None:
        raise error
    if rank() == 0:
        failed = [r for r, files in enumerate(claimed) if files is None]
        if failed:
            raise RuntimeError(f"rank(s) {failed} could not read back the files they wrote")
        write_manifest(tmp, {name: c for files in claimed if files is not None for name, c in files.items()})

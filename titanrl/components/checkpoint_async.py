"""The async checkpoint writer: DCP writes a save in a background thread, then publishes it.

The save copies the state to host memory and returns; DCP's writer thread writes it over a gloo
group of its own (so that its collectives never interleave with training's, which run on the
default group in the training thread) and rank 0 renames the folder once the write has finished.
"""

import gc
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titanrl.components.checkpoint_folder import CheckpointFolder
from titanrl.components.faults import fault_point


class AsyncCheckpointWriter:
    """At most one save in flight (`pending`: its step, temporary folder, and a future done
    once it is written and published into `folder`)."""

    def __init__(self, folder: CheckpointFolder) -> None:
        self.folder = folder
        self.pending: tuple[int, str, Future] | None = None
        self.group: dist.ProcessGroup | None = None

    def start(self, step: int, tmp: str, state: dict[str, Any]) -> None:
        """Collective: begin writing `state` into `tmp`; returns once it is staged in host memory."""
        assert self.pending is None, "an async save is still in flight: wait for it first"
        written = dcp.async_save(state, checkpoint_id=tmp, process_group=self._process_group())
        assert isinstance(written, Future), "DCP returns a plain future without an async stager"
        self.pending = (step, tmp, self._publish_when_written(step, tmp, written))

    def take_pending(self) -> tuple[int, str, Future] | None:
        """The save in flight, if any, which the caller now waits for."""
        pending, self.pending = self.pending, None
        return pending

    def close(self) -> None:
        """Destroy the writer's group, once no save is in flight, before the default group is.
        After a failed async save, reference cycles (the error's traceback frames, DCP's
        `_DistWrapper`) keep the group alive until a garbage collection, which could be the one
        at interpreter exit: its gloo threads were then torn down in whatever order finalisation
        picked, and a rank aborted ("terminate called without an active exception", CI).
        Collected here, while the process is whole. With a save still in flight (a failing run),
        the group is left to its writer thread."""
        if self.group is not None and self.pending is None:
            dist.destroy_process_group(self.group)
            self.group = None
            gc.collect()

    def _process_group(self) -> dist.ProcessGroup | None:
        """The writer's own gloo group (created once, collectively): DCP's collectives run in its
        background thread, and on the training group they could interleave with the training
        thread's own collectives in a different order on different ranks."""
        if dist.is_initialized() and self.group is None:
            self.group = dist.new_group(backend="gloo")
        return self.group

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
                self.folder.publish(step, tmp, self.group)
                published.set_result(None)
            except BaseException as e:
                published.set_exception(e)

        written.add_done_callback(publish)  # runs in DCP's writer thread (or here, if already done)
        return published

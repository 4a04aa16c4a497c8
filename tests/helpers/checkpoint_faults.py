"""Faults injected into checkpoint folders: storage bit flips and forged host state (shared by
tests/test_checkpoint.py and tests/test_checkpoint_integrity.py)."""

import json
import os

import torch

from titanrl.components.checkpoint_integrity import MANIFEST, file_checksum


def flip(path, offset_frac: float = 0.5, n: int = 16) -> None:
    """Invert `n` bytes inside a file, its size unchanged: a storage bit flip."""
    data = bytearray(open(path, "rb").read())
    at = min(int(len(data) * offset_frac), len(data) - n)
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    open(path, "wb").write(bytes(data))


def kind_file(step_dir, kind: str) -> str:
    """The file of a kind ('shard', 'metadata', 'host') in a checkpoint folder."""
    name = {"metadata": ".metadata", "host": "host_rank0.pt"}.get(kind)
    if name is None:
        name = next(n for n in sorted(os.listdir(step_dir)) if n.endswith(".distcp"))
    return os.path.join(step_dir, name)


def rewrite_manifest(step_dir, name: str) -> None:
    """Record `name`'s current checksum in the manifest, as a forger who rewrote it would."""
    file = os.path.join(step_dir, MANIFEST)
    manifest = json.load(open(file))
    manifest["files"][name] = file_checksum(os.path.join(step_dir, name))
    json.dump(manifest, open(file, "w"))


class RunsCode:
    """Pickles as a call of os.system: what a forged host-state file would carry."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_code(step_dir, marker: str) -> None:
    """Replace the host state with a pickle that would create `marker` when loaded unsafely."""
    torch.save({"step": 2, "loader": RunsCode(marker)}, os.path.join(step_dir, "host_rank0.pt"))
    rewrite_manifest(step_dir, "host_rank0.pt")

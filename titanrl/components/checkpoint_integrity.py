"""Checkpoint integrity: a checksum manifest per checkpoint, and host state that is data, not code.

Every `step-N/` folder holds `checksums.json`: each file's size and CRC-32, written before the
rename that publishes the checkpoint. Each rank hashes the files it wrote (its DCP shards
`__<rank>_*.distcp` and `host_rank<rank>.pt`) right after writing them, from the page cache;
rank 0 gathers the lists, hashes what no rank claimed (DCP's `.metadata`) and writes the
manifest. On load, the ranks share the files out, check them and agree: one changed byte
rejects the checkpoint with one line naming the file.

CRC-32 (zlib) and not a cryptographic hash: it guards against storage flipping bits, not
against someone who can also rewrite the manifest, and it is the fastest checksum in the
standard library (benchmarks/bench_checkpoint.json). What a forged checkpoint could do is
bounded by loading host state with `weights_only=True`: tensors and plain containers only.
"""

import json
import os
import pickle
import re
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

MANIFEST = "checksums.json"
_CHUNK = 8 << 20


class CheckpointCorrupt(ValueError):
    """A checkpoint's files are not what was written (or its host state is not plain data)."""


def file_checksum(path: str) -> dict[str, Any]:
    """{'size', 'crc32'} of a file, read in chunks (zlib releases the GIL on large buffers, so an
    async writer thread hashing does not stall training)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def rank_files(folder: str, rank: int) -> list[str]:
    """The files `rank` wrote into a checkpoint folder: DCP names a rank's shards '__<rank>_<i>'."""
    own = re.compile(rf"__{rank}_\d+\.distcp|host_rank{rank}\.pt")
    return sorted(name for name in os.listdir(folder) if own.fullmatch(name))


def checksums(folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_checksum(os.path.join(folder, name)) for name in names}


def write_manifest(folder: str, claimed: dict[str, dict[str, Any]]) -> None:
    """Rank 0: the manifest of every file in `folder`, from the ranks' `claimed` checksums plus
    its own of the files no rank claimed."""
    rest = sorted(set(os.listdir(folder)) - set(claimed) - {MANIFEST})
    files = {**claimed, **checksums(folder, rest)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format": 1, "algorithm": "crc32", "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's {file: {'size', 'crc32'}}, or None for a checkpoint written without one."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("algorithm") != "crc32" or not isinstance(files, dict):
            raise ValueError(f"algorithm {manifest.get('algorithm')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise corrupt(path, f"{MANIFEST} cannot be read ({type(e).__name__}: {e})") from None
    return files


def check_files(files: dict[str, dict[str, Any]], path: str, names: list[str]) -> str | None:
    """How the first of `names` differs from the manifest `files`, in a few words; None if all match."""
    for name in names:
        want, file = files[name], os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        got = file_checksum(file)
        if got["size"] != want["size"]:
            return f"{name} has {got['size']} bytes, {MANIFEST} says {want['size']}"
        if got["crc32"] != want["crc32"]:
            return f"{name} has CRC-32 {got['crc32']}, {MANIFEST} says {want['crc32']} (changed after it was written)"
    return None


def corrupt(path: str, problem: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"checkpoint {path} is corrupt: {problem}")


def verify_checkpoint(path: str) -> None:
    """Check every file of the checkpoint folder `path` against its manifest, and that its host
    state loads as plain data; raise `CheckpointCorrupt` with one line naming the file if not. A
    checkpoint written without a manifest passes (it cannot be checked; loading it says so)."""
    files = read_manifest(path)
    if files is not None:
        problem = check_files(files, path, sorted(files))
        if problem is not None:
            raise corrupt(path, problem)
    for name in sorted(os.listdir(path)):
        if re.fullmatch(r"host_rank\d+\.pt", name):
            load_host_state(os.path.join(path, name))


def load_host_state(file: str) -> dict[str, Any]:
    """Host state (loader position, RNG, counters, groups in flight) as tensors and plain
    containers: `weights_only=True` never calls a constructor or function named in the file, so
    a checkpoint from elsewhere cannot run code here. Anything else is refused in one line."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        found = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
        folder, name = os.path.split(file)
        raise CheckpointCorrupt(
            f"checkpoint {folder} is refused: {name} is not plain data (it asks for {found}, which could run "
            "code; nothing in it was run); load only checkpoints that titanrl wrote"
        ) from None


def summary(error: BaseException) -> str:
    """One line for an error of a checkpoint load: DCP's CheckpointException carries each rank's
    traceback in its message, so the first failure's type and first line stand for it."""
    if isinstance(error, CheckpointException) and error.failures:
        error, _ = next(iter(error.failures.values()))  # (exception, traceback) of the first rank
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")

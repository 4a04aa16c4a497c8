"""Which data a run trained on, recorded in its checkpoints, so that a resume on other data stops.

A data file's identity is its absolute path, its size in bytes (a `datasets` folder: the sum of
its files) and a SHA-256 of the rows the loader read from it: every row, all of its columns, in
file order, each as canonical JSON (sorted keys), before any is dropped or held out. So the hash
changes exactly when what the run reads changes (rows added, removed, reordered or edited), and
not when only the bytes do (another JSON spacing, a Parquet file rewritten with other
compression). Hashing costs one JSON encoding per row, on top of the parse the loader does anyway.

The prompt loader (`data.prompts.build_prompt_loader`) stores the identities in its state, which
the Trainer checkpoints; `check_sources` compares them on resume. A changed file stops the job
with one line naming it and the fix, unless `data.allow_changed` is set.
"""

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torchdata.nodes as tn

from titanrl.components.console import get_logger

log = get_logger(__name__)

SOURCES_KEY = "data_sources"
"""The loader state's entry with the identities of its data files."""


@dataclass
class DataSource:
    path: str
    """Absolute path of the file or `datasets` folder."""

    size: int
    """Bytes on disk (a folder: the sum of its files)."""

    rows: int = 0
    """Rows read (before any is dropped or held out)."""

    sha256: str = ""
    """SHA-256 of the rows read, each as canonical JSON, in file order."""

    allow_changed: bool = False
    """This run's data.allow_changed: resume even if the checkpoint read other rows (not part of
    the identity)."""

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records: plain types only (host state loads with weights_only)."""
        return {"path": self.path, "size": self.size, "rows": self.rows, "sha256": self.sha256}

    def describe(self) -> str:
        return f"{self.rows} rows, {self.size} bytes, rows sha256 {self.sha256[:12]}"


def bytes_on_disk(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def hashed_rows(rows: Iterable[tuple[str, dict]], source: DataSource) -> Iterator[tuple[str, dict]]:
    """`rows` (where, row) unchanged, hashed into `source` as they pass; `source.sha256` is set
    when the last row has passed."""
    digest = hashlib.sha256()
    for where, row in rows:  # surrogatepass: a row with a lone surrogate is refused by its reader, not here
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
        source.rows += 1
        yield where, row
    source.sha256 = digest.hexdigest()


def new_source(path: str, allow_changed: bool) -> DataSource:
    """The identity of `path` before its rows are read (`hashed_rows` completes it)."""
    size = bytes_on_disk(path) if os.path.exists(path) else 0  # a missing file: the reader names it
    return DataSource(os.path.abspath(path), size, allow_changed=allow_changed)


def sources_in(data: Any) -> list[DataSource]:
    """The data sources of the rows in `data`: rows, or tuples / lists of rows (a recipe's data)."""
    found: dict[int, DataSource] = {}
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, (list, tuple)):
            todo.extend(item)
        elif getattr(item, "source", None) is not None:
            found.setdefault(id(item.source), item.source)
    return sorted(found.values(), key=lambda s: s.path)


class ProvenanceLoader(tn.Loader):
    """torchdata's Loader whose state also names the data files it reads (`SOURCES_KEY`), and
    which checks them when a checkpoint's state is loaded."""

    def __init__(self, root: tn.BaseNode, sources: list[DataSource]) -> None:
        super().__init__(root)
        self.sources = sources

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), SOURCES_KEY: [s.identity() for s in self.sources]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        check_sources(state.pop(SOURCES_KEY, None), self.sources, notify=os.environ.get("RANK", "0") == "0")
        super().load_state_dict(state)


def check_sources(saved: list[dict] | None, current: list[DataSource], notify: bool = True) -> None:
    """Raise ValueError if the checkpoint's data files (`saved`: their identities; None for a
    checkpoint saved before they were recorded) are not the rows this run reads (`current`),
    unless data.allow_changed; `notify`: print the one-line notices (rank 0)."""
    say = (lambda text: log.info(f"titanrl: notice: {text}")) if notify else (lambda text: None)
    if saved is None:
        if current:
            say(
                f"the checkpoint does not record the data it was trained on (saved by an older titanrl), so "
                f"data.path '{current[0].path}' cannot be checked against it; resuming"
            )
        return
    now = {s.sha256: s for s in current}
    for old in saved:
        if old["sha256"] in now:
            continue
        new = next((s for s in current if s.path == old["path"]), current[0] if current else None)
        if new is not None and new.allow_changed:
            say(
                f"data.path '{new.path}' changed since the checkpoint ({old['rows']} -> {new.rows} rows); "
                "resuming on the new rows as data.allow_changed = true asks"
            )
            continue
        raise ValueError(changed_message(old, new))


def changed_message(old: dict, new: DataSource | None) -> str:
    then = f"{old['rows']} rows, {old['size']} bytes, rows sha256 {old['sha256'][:12]}"
    if new is None:
        what = f"this run reads no data.path, but the checkpoint was trained on '{old['path']}' ({then})"
    elif new.path == old["path"]:
        what = f"data.path '{new.path}' changed since the checkpoint was saved ({then} then, {new.describe()} now)"
    else:
        what = f"data.path '{new.path}' ({new.describe()}) is not the checkpoint's data '{old['path']}' ({then})"
    return (
        f"{what}: resuming would train on other rows than the run did. Restore the file, pass "
        "--data.allow_changed=true to continue on the new data on purpose, or start a fresh run in another "
        "--job.dump_folder"
    )

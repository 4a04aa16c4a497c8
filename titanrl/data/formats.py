"""Prompt-data files and their rows: readers for JSONL, Parquet and Hugging Face `datasets` folders,
and `RowSchema`, which turns one row into a `Sample`.

The reader is picked by the path: a folder is a `datasets` `save_to_disk` folder (its `.arrow`
shards, read with pyarrow; the `datasets` package is not needed), `.parquet` a Parquet file,
`.arrow` one Arrow shard, anything else JSONL. Parquet and Arrow need `pyarrow` (optional extra
`data`). Every row comes with where it is, for errors: `file:line` for JSONL (1-based lines),
`file row i` for the others (0-based, as `datasets` and pandas index rows); a Sample read here
is a `RowSample`, which keeps it (`where`) so that later checks (a prompt too long in tokens,
`titanrl.data.encode`) can name the row too. Text must be valid Unicode: a JSONL file that is
not UTF-8, a Parquet / Arrow string that is not, or an unpaired surrogate escape ("\\ud83d")
is an error naming the row and the fix.

A row's prompt is a non-empty string or a list of chat messages ({"role", "content"} dicts, e.g.
verl's `prompt` column); messages are kept in `Sample.metadata["messages"]` for a chat template,
and `Sample.prompt` is then their contents joined by blank lines. The answer is a string or a
number (verl's `reward_model.ground_truth` when the row has no answer column and the default key
is used). Keys may be dotted paths into nested columns ("extra_info.question"). Every other column
is kept in `Sample.metadata`.
"""

import json
import math
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

from titanrl.data.provenance import DataSource
from titanrl.data.tasks import Sample

DATA_EXTRA = 'pip install -e ".[data]"'
VERL_ANSWER_KEY = "reward_model.ground_truth"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            f"reading Parquet / Arrow prompt data needs the 'pyarrow' package (optional extra 'data'): {DATA_EXTRA}"
        ) from None
    return pyarrow


def _not_utf8(path: str, line_no: int, raw: bytes, error: UnicodeDecodeError, offset: int) -> str:
    """The error for a JSONL line that is not UTF-8: where the bad byte is, and how to convert the file."""
    quoted = shlex.quote(path)
    if line_no == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # e.g. PowerShell's `>` writes UTF-16
        return (
            f"{path}:1: the file is UTF-16 (it starts with a UTF-16 byte-order mark), not UTF-8; convert it, "
            f"e.g. iconv -f UTF-16 -t UTF-8 {quoted} > converted.jsonl"
        )
    bad = raw[error.start : error.end]
    context = raw[max(0, error.start - 20) : error.end + 20]
    return (
        f"{path}:{line_no}: not valid UTF-8: byte {bad[0]:#04x} at byte {error.start + 1} of the line "
        f"(file offset {offset + error.start}), in {context!r}; data files must be UTF-8: convert it from "
        f"its encoding, e.g. iconv -f LATIN1 -t UTF-8 {quoted} > converted.jsonl for Latin-1 (list the bad "
        f"lines with: grep -naxv '.*' {quoted})"
    )


_ONE_OBJECT = "JSON Lines needs one JSON object per line"
_ARRAY_HINT = (
    "the file looks like one JSON array, not JSON Lines (one object per line); convert it, e.g. "
    "jq -c '.[]' {} > converted.jsonl"
)


def read_jsonl_objects(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line; a missing file, bytes that are not UTF-8,
    invalid JSON or a non-object row is an error naming the file and line."""
    try:
        f = open(path, "rb")  # bytes: a decoding error then knows its line (text mode's reads span lines)
    except FileNotFoundError:
        raise ValueError(f"data.path '{path}' does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"data.path '{path}' is a folder, not a JSONL file") from None
    offset = 0
    with f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(_not_utf8(path, line_no, raw, e, offset)) from None
            offset += len(raw)
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark (Windows editors write one)
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            array = line_no == 1 and line.lstrip().startswith("[")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                at = f"at column {e.colno}"
                if e.pos >= len(line.rstrip()):
                    at = "at the end of the line: is it cut short, or one object written over several lines?"
                raise ValueError(
                    f"{path}:{line_no}: not valid JSON ({e.msg} {at}); "
                    f"{_ARRAY_HINT.format(shlex.quote(path)) if array else _ONE_OBJECT}"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}"
                    f"{'; ' + _ARRAY_HINT.format(shlex.quote(path)) if array else ''}"
                )
            yield line_no, row


def _batch_rows(batch, path: str, first: int) -> list[dict]:
    """The rows of one Arrow record batch; a string that is not UTF-8 is an error naming its row
    and column (pyarrow would raise a bare UnicodeDecodeError)."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError as e:
        error = e
    for i in range(batch.num_rows):
        for name in batch.schema.names:
            try:
                batch.column(name)[i].as_py()
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} row {first + i}: column '{name}' is not valid UTF-8 (byte {e.object[e.start]:#04x} at "
                    f"byte {e.start + 1} of {e.object[:40]!r}); decode that text with its real encoding where the "
                    "file is written (e.g. bytes.decode('latin-1') in pandas) and write the file again"
                ) from None
    raise ValueError(f"{path} rows {first}..{first + batch.num_rows - 1}: not valid UTF-8 ({error})") from None


def _table_rows(table_batches, path: str) -> Iterator[tuple[str, dict]]:
    index = 0
    for batch in table_batches:
        for row in _batch_rows(batch, path, index):
            yield f"{path} row {index}", row
            index += 1


def _read_parquet(path: str) -> Iterator[tuple[str, dict]]:
    pa = _pyarrow()
    try:  # the consumer's errors are raised outside this generator, so only reading errors land here
        yield from _table_rows(pa.parquet.ParquetFile(path).iter_batches(), path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None


def _arrow_table(path: str):
    """One Arrow shard: the IPC stream format `datasets` writes, or the IPC file format."""
    pa = _pyarrow()
    try:
        with pa.memory_map(path) as source:
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow file ({e})") from None


def dataset_folder_shards(folder: str) -> list[str]:
    """The .arrow shards of a `datasets` save_to_disk folder, in order (state.json's `_data_files`)."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        splits = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
        raise ValueError(
            f"'{folder}' is a DatasetDict ({', '.join(splits)}); point data.path at one split's "
            f"folder, e.g. '{os.path.join(folder, 'train' if 'train' in splits or not splits else splits[0])}'"
        )
    state_path = os.path.join(folder, "state.json")
    if os.path.isfile(state_path):
        try:
            with open(state_path, encoding="utf-8") as f:
                files = [entry["filename"] for entry in json.load(f)["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{state_path}: not a datasets state.json (no _data_files list: {e})") from None
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".arrow"))
        if not files or not os.path.isfile(os.path.join(folder, "dataset_info.json")):
            raise ValueError(
                f"data.path '{folder}' is a folder but not a datasets save_to_disk folder "
                "(no state.json, or dataset_info.json and .arrow files); point it at a .jsonl or "
                ".parquet file or such a folder"
            )
    shards = [os.path.join(folder, name) for name in files]
    for shard in shards:
        if not os.path.isfile(shard):
            raise ValueError(f"{state_path}: lists '{os.path.basename(shard)}', which is missing")
    return shards


def _read_dataset_folder(folder: str) -> Iterator[tuple[str, dict]]:
    shards = dataset_folder_shards(folder)
    _pyarrow()
    yield from _table_rows((batch for shard in shards for batch in _arrow_table(shard).to_batches()), folder)


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of each row of a prompt-data file or folder, by its extension / contents."""
    if os.path.isdir(path):
        yield from _read_dataset_folder(path)
        return
    if not os.path.exists(path):
        raise ValueError(f"data.path '{path}' does not exist")
    lower = path.lower()
    if lower.endswith(".parquet"):
        yield from _read_parquet(path)
    elif lower.endswith(".arrow"):
        _pyarrow()
        yield from _table_rows(_arrow_table(path).to_batches(), path)
    else:
        for line_no, row in read_jsonl_objects(path):
            yield f"{path}:{line_no}", row


_MISSING = object()


def lookup(row: dict, key: str):
    """row[key], else the dotted path key ('a.b' -> row['a']['b']); `_MISSING` when absent or None."""
    if key in row:
        value = row[key]
    else:
        value = row
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return _MISSING
            value = value[part]
    return _MISSING if value is None else value


def shown(value) -> str:
    """A value for an error message: its type and a repr cut to a readable length."""
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def check_unicode(text: str, where: str, field: str) -> None:
    """An unpaired surrogate ("\\ud83d" escaped alone in JSON) is not Unicode: it could not be
    tokenized, so the run would fail when the row is drawn."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: {field} has an unpaired surrogate {text[e.start]!r} at character {e.start + 1}, which is not "
            "valid Unicode (a JSON \\uXXXX escape of half an emoji or other 2-part character); fix the text where "
            "the file is written (e.g. drop the lone escape)"
        ) from None


def check_messages(messages: list, where: str, key: str) -> list[dict]:
    """Chat messages without None entries (from Parquet struct columns); a malformed one is an error."""
    if not messages:
        raise ValueError(f"{where}: '{key}' is an empty message list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"{where}: '{key}' message {i} must be a {{'role', 'content'}} object, got {shown(message)}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"{where}: '{key}' message {i} has no 'role' string")
        if not isinstance(message.get("content", ""), str) or (
            "content" not in message and "tool_calls" not in message
        ):
            got = shown(message["content"]) if "content" in message else "nothing"
            raise ValueError(f"{where}: '{key}' message {i} needs a 'content' string, got {got}")
        check_unicode(message.get("content", ""), where, f"'{key}' message {i}")
        out.append(message)
    return out


def messages_text(messages: list[dict]) -> str:
    """The template-free text of a message list: the contents joined by blank lines."""
    return "\n\n".join(m["content"] for m in messages if m.get("content"))


def _scalar(value, where: str, key: str) -> str:
    """A string or finite number column as text; anything else is an error naming the column."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        got = "nothing" if value is _MISSING else shown(value)
        raise ValueError(f"{where}: '{key}' must be a string or a number, got {got}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: '{key}' is {value}, not a finite number")
    if isinstance(value, str):
        check_unicode(value, where, f"'{key}'")
    return str(value)


@dataclass
class RowSample(Sample):
    """A Sample read from a data file, with where it is there, for errors found after loading."""

    where: str = ""
    """`file:line` (JSONL, 1-based) or `file row i` (Parquet, Arrow, datasets folders; 0-based)."""

    source: DataSource | None = field(default=None, repr=False, compare=False)
    """The file it was read from (`titanrl.data.provenance`), recorded in checkpoints."""


def sample_where(sample: object, index: int) -> str:
    """Where a sample is: its file and line or row, or `sample {index}` for one not read from a file."""
    return getattr(sample, "where", "") or f"sample {index}"


@dataclass
class RowSchema:
    """Where a row keeps its prompt, answer and (optional) worked solution."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    solution_key: str = "solution"

    def to_sample(self, row: dict, where: str) -> RowSample:
        """The row as a Sample; a malformed row is an error starting with `where` and naming the column."""
        prompt = lookup(row, self.prompt_key)
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key, self.solution_key)}
        if isinstance(prompt, list):
            messages = check_messages(prompt, where, self.prompt_key)
            metadata["messages"] = messages
            prompt = messages_text(messages)
            if not prompt.strip():
                raise ValueError(f"{where}: '{self.prompt_key}' messages have no text")
        elif not isinstance(prompt, str) or not prompt.strip():
            got = "nothing" if prompt is _MISSING else shown(prompt)
            raise ValueError(
                f"{where}: missing or empty '{self.prompt_key}': got {got} (a non-empty string or a "
                "list of {role, content} messages is required)"
            )
        else:
            check_unicode(prompt, where, f"'{self.prompt_key}'")
        answer = lookup(row, self.answer_key)
        if answer is _MISSING and self.answer_key == "answer":
            answer = lookup(row, VERL_ANSWER_KEY)  # verl rows: {"reward_model": {"ground_truth": ...}}
        answer = _scalar(answer, where, self.answer_key)
        solution = lookup(row, self.solution_key)
        solution = answer if solution is _MISSING else _scalar(solution, where, self.solution_key)
        return RowSample(prompt=prompt, answer=answer, solution=solution, metadata=metadata, where=where)

"""Prompt-data files and their rows: readers for JSONL, Parquet and Hugging Face `datasets` folders,
and `RowSchema`, which turns one row into a `Sample`.

The reader is picked by the path: a folder is a `datasets` `save_to_disk` folder (its `.arrow`
shards, read with pyarrow; the `datasets` package is not needed), `.parquet` a Parquet file,
`.arrow` one Arrow shard, anything else JSONL. Parquet and Arrow need `pyarrow` (optional extra
`data`). Every row comes with where it is, for errors: `file:line` for JSONL (1-based lines),
`file row i` for the others (0-based, as `datasets` and pandas index rows).

A row's prompt is a non-empty string or a list of chat messages ({"role", "content"} dicts, e.g.
verl's `prompt` column); messages are kept in `Sample.metadata["messages"]` for a chat template,
and `Sample.prompt` is then their contents joined by blank lines. The answer is a string or a
number (verl's `reward_model.ground_truth` when the row has no answer column and the default key
is used). Keys may be dotted paths into nested columns ("extra_info.question"). Every other column
is kept in `Sample.metadata`.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from titanrl.envs.tasks import Sample

DATA_EXTRA = 'pip install -e ".[data]"'
VERL_ANSWER_KEY = "reward_model.ground_truth"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"reading Parquet / Arrow prompt data needs the 'pyarrow' package (optional extra 'data'): "
                         f"{DATA_EXTRA}") from None
    return pyarrow


def read_jsonl_objects(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-empty line; a missing file, invalid JSON or a non-object
    row is an error naming the file and line."""
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"data.path '{path}' does not exist") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def _table_rows(table_batches, path: str) -> Iterator[tuple[str, dict]]:
    index = 0
    for batch in table_batches:
        for row in batch.to_pylist():
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
        raise ValueError(f"'{folder}' is a DatasetDict ({', '.join(splits)}); point data.path at one split's "
                         f"folder, e.g. '{os.path.join(folder, 'train' if 'train' in splits or not splits else splits[0])}'")
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
            raise ValueError(f"data.path '{folder}' is a folder but not a datasets save_to_disk folder "
                             "(no state.json, or dataset_info.json and .arrow files); point it at a .jsonl or "
                             ".parquet file or such a folder")
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


def check_messages(messages: list, where: str, key: str) -> list[dict]:
    """Chat messages without None entries (from Parquet struct columns); a malformed one is an error."""
    if not messages:
        raise ValueError(f"{where}: '{key}' is an empty message list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: '{key}' message {i} must be a {{'role', 'content'}} object, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"{where}: '{key}' message {i} has no 'role' string")
        if not isinstance(message.get("content", ""), str) or ("content" not in message and "tool_calls" not in message):
            raise ValueError(f"{where}: '{key}' message {i} needs a 'content' string, got {message.get('content')!r}")
        out.append(message)
    return out


def messages_text(messages: list[dict]) -> str:
    """The template-free text of a message list: the contents joined by blank lines."""
    return "\n\n".join(m["content"] for m in messages if m.get("content"))


@dataclass
class RowSchema:
    """Where a row keeps its prompt, answer and (optional) worked solution."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    solution_key: str = "solution"

    def to_sample(self, row: dict, where: str) -> Sample:
        """The row as a Sample; a malformed row is an error starting with `where`."""
        prompt = lookup(row, self.prompt_key)
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key, self.solution_key)}
        if isinstance(prompt, list):
            messages = check_messages(prompt, where, self.prompt_key)
            metadata["messages"] = messages
            prompt = messages_text(messages)
            if not prompt:
                raise ValueError(f"{where}: '{self.prompt_key}' messages have no text")
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: missing or empty '{self.prompt_key}' (a non-empty string or a list of "
                             "{role, content} messages is required)")
        answer = lookup(row, self.answer_key)
        if answer is _MISSING and self.answer_key == "answer":
            answer = lookup(row, VERL_ANSWER_KEY)  # verl rows: {"reward_model": {"ground_truth": ...}}
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            got = "nothing" if answer is _MISSING else repr(answer)
            raise ValueError(f"{where}: '{self.answer_key}' must be a string or a number, got {got}")
        solution = lookup(row, self.solution_key)
        if solution is _MISSING:
            solution = answer
        elif isinstance(solution, bool) or not isinstance(solution, (str, int, float)):
            raise ValueError(f"{where}: '{self.solution_key}' must be a string or a number, got {solution!r}")
        return Sample(prompt=prompt, answer=str(answer), solution=str(solution), metadata=metadata)

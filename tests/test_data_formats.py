"""Prompt-data formats: JSONL, Parquet and datasets save_to_disk folders; text and chat-message
prompts; verl-style rows; configurable columns; the prompt-length limit; malformed rows."""

import json

import pytest

from titanrl.config import load_config
from titanrl.data.formats import RowSchema, read_rows
from titanrl.data.prompts import load_jsonl, load_samples, samples_from_config

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # the 'data' extra: JSONL tests still run
    pa = pq = None
needs_pyarrow = pytest.mark.skipif(pa is None, reason="needs pyarrow (extra 'data')")

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_row(i: int, question: str = QUESTION, answer: str = "72") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": i, "answer": f"48/2 = 24 ... #### {answer}", "question": question},
    }


VERL_ROWS = [verl_row(0), verl_row(1, "What is 6 times 7?", "42"), verl_row(2, "What is 2+2?", "4")]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    """Rows as a Parquet table (every column in every row: an absent value is null, as from pandas)."""
    columns = dict.fromkeys(k for row in rows for k in row)
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows]), str(path))
    return str(path)


def _dataset_folder(folder, rows, shards=2):
    """The layout of `datasets.Dataset.save_to_disk`: Arrow IPC-stream shards, state.json, dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    names, per_shard = [], -(-len(rows) // shards)
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.ipc.new_stream(str(folder / name), table.schema) as writer:
            writer.write_table(table.slice(s * per_shard, per_shard))
        names.append(name)
    (folder / "state.json").write_text(
        json.dumps(
            {
                "_data_files": [{"filename": n} for n in names],
                "_fingerprint": "0",
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            }
        )
    )
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return str(folder)


def _check_verl(samples):
    assert [s.answer for s in samples] == ["72", "42", "4"]
    first = samples[0]
    assert first.prompt == QUESTION + " " + INSTRUCTION and first.solution == "72"
    assert first.metadata["messages"] == VERL_ROWS[0]["prompt"]
    assert first.metadata["data_source"] == "openai/gsm8k" and first.metadata["ability"] == "math"
    assert first.metadata["extra_info"] == VERL_ROWS[0]["extra_info"]
    assert first.metadata["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert "prompt" not in first.metadata


@needs_pyarrow
def test_verl_rows_load_from_jsonl_parquet_and_dataset_folder(tmp_path):
    for path in (
        _jsonl(tmp_path / "gsm8k.jsonl", VERL_ROWS),
        _parquet(tmp_path / "gsm8k.parquet", VERL_ROWS),
        _dataset_folder(tmp_path / "gsm8k_ds", VERL_ROWS),
    ):
        _check_verl(load_samples(path))
    assert [s.answer for s in load_jsonl(str(tmp_path / "gsm8k.parquet"))] == ["72", "42", "4"]  # recipes' call
    single = tmp_path / "gsm8k_ds" / "data-00000-of-00002.arrow"
    assert [s.answer for s in load_samples(str(single))] == ["72", "42"]


@needs_pyarrow
def test_real_datasets_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(VERL_ROWS).shuffle(seed=0).save_to_disk(str(tmp_path / "ds"))
    samples = load_samples(str(tmp_path / "ds"))
    assert sorted(s.answer for s in samples) == ["4", "42", "72"]
    _check_verl(sorted(samples, key=lambda s: s.metadata["extra_info"]["index"]))


def test_text_and_message_prompts(tmp_path):
    rows = [
        {"prompt": "1+1=", "answer": 2, "level": 1},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
            "answer": "4",
            "solution": "2+2=4",
        },
    ]
    text, chat = load_samples(_jsonl(tmp_path / "p.jsonl", rows))  # one file may mix both kinds
    assert (text.prompt, text.answer, text.solution, text.metadata) == ("1+1=", "2", "2", {"level": 1})
    assert chat.prompt == "Be brief.\n\n2+2=" and (chat.answer, chat.solution) == ("4", "2+2=4")
    assert chat.metadata == {"messages": rows[1]["prompt"]}


@needs_pyarrow
def test_message_prompts_from_parquet(tmp_path):
    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
            "answer": "4",
            "solution": "2+2=4",
        }
    ]
    # Parquet unifies columns: absent values come back as None and count as absent.
    chat_rows = [rows[0], {"prompt": [{"role": "user", "content": "3+3="}], "answer": "6", "level": 2}]
    first, second = load_samples(_parquet(tmp_path / "p.parquet", chat_rows))
    assert (first.prompt, first.solution, first.metadata) == (
        "Be brief.\n\n2+2=",
        "2+2=4",
        {"level": None, "messages": rows[0]["prompt"]},
    )
    assert (second.prompt, second.solution, second.metadata["level"]) == ("3+3=", "6", 2)


@needs_pyarrow
def test_custom_column_names(tmp_path):
    rows = [{"question": "What is 3*3?", "label": 9, "worked": "3*3=9", "extra_info": {"q": "nested?"}}]
    path = _parquet(tmp_path / "custom.parquet", rows)
    [s] = load_samples(path, prompt_key="question", answer_key="label", solution_key="worked")
    assert (s.prompt, s.answer, s.solution, s.metadata) == (
        "What is 3*3?",
        "9",
        "3*3=9",
        {"extra_info": {"q": "nested?"}},
    )
    [s] = load_samples(path, prompt_key="extra_info.q", answer_key="label")  # a dotted path into a nested column
    assert s.prompt == "nested?" and s.metadata["question"] == "What is 3*3?"
    # From the [data] section; a custom answer key does not fall back to verl's ground_truth.
    config = load_config(
        [
            f"--data.path={path}",
            "--data.prompt_key=question",
            "--data.answer_key=label",
            "--data.solution_key=worked",
        ]
    )
    assert samples_from_config(config.data)[0].solution == "3*3=9"
    verl = _jsonl(tmp_path / "verl.jsonl", VERL_ROWS)
    with pytest.raises(ValueError, match=r"verl.jsonl:1: 'label' must be a string or a number, got nothing"):
        load_samples(verl, answer_key="label")
    assert load_samples(verl, answer_key="reward_model.ground_truth")[1].answer == "42"


@needs_pyarrow
def test_long_prompts_drop_or_error(tmp_path, capsys):
    rows = [{"prompt": "short", "answer": 1}, {"prompt": "x" * 50, "answer": 2}, {"prompt": "y" * 11, "answer": 3}]
    path = _parquet(tmp_path / "long.parquet", rows)
    kept = load_samples(path, max_prompt_chars=10)
    assert [s.answer for s in kept] == ["1"]
    assert (
        f"{path}: dropped 2 of 3 rows whose prompt is longer than data.max_prompt_chars (10" in capsys.readouterr().out
    )
    with pytest.raises(
        ValueError,
        match=r"long.parquet row 1: the prompt has 50 characters, more than "
        r"data.max_prompt_chars \(10\)",
    ):
        load_samples(path, max_prompt_chars=10, on_long_prompt="error")
    assert len(load_samples(path, max_prompt_chars=0)) == 3  # 0 = no limit
    with pytest.raises(ValueError, match="has no rows left after dropping 3"):
        load_samples(path, max_prompt_chars=2)
    # Messages count by their joined text; from the [data] section.
    verl = _jsonl(tmp_path / "verl.jsonl", VERL_ROWS)
    config = load_config([f"--data.path={verl}", "--data.max_prompt_chars=100", "--data.on_long_prompt=error"])
    with pytest.raises(ValueError, match=r"verl.jsonl:1: the prompt has \d+ characters"):
        samples_from_config(config.data)
    with pytest.raises(ValueError, match="max_prompt_chars must be >= 0"):
        load_config(["--data.max_prompt_chars=-1"])
    with pytest.raises(ValueError, match="on_long_prompt"):
        load_config(["--data.on_long_prompt=skip"])


def test_malformed_jsonl_rows_name_file_and_line(tmp_path):
    jsonl_cases = {
        '{"prompt": [], "answer": 1}': r"bad.jsonl:2: 'prompt' is an empty message list",
        '{"prompt": [{"content": "hi"}], "answer": 1}': r"bad.jsonl:2: 'prompt' message 0 has no 'role'",
        '{"prompt": [{"role": "user", "content": 5}], "answer": 1}': r"bad.jsonl:2: 'prompt' message 0 needs a 'content'",
        '{"prompt": ["hi"], "answer": 1}': r"bad.jsonl:2: 'prompt' message 0 must be a \{'role', 'content'\}",
        '{"prompt": 7, "answer": 1}': r"bad.jsonl:2: missing or empty 'prompt'",
        '{"prompt": "p", "answer": true}': r"bad.jsonl:2: 'answer' must be a string or a number",
        '{"prompt": "p", "answer": 1, "solution": {"a": 1}}': r"bad.jsonl:2: 'solution' must be a string or a number",
        '{"prompt": "p", "reward_model": {"ground_truth": ["1", "2"]}}': r"bad.jsonl:2: 'answer' must be a string",
    }
    for text, pattern in jsonl_cases.items():
        (tmp_path / "bad.jsonl").write_text('{"prompt": "ok", "answer": 0}\n' + text + "\n")
        with pytest.raises(ValueError, match=pattern):
            load_samples(str(tmp_path / "bad.jsonl"))


@needs_pyarrow
def test_malformed_parquet_and_folder_rows_name_the_row(tmp_path):
    rows = [{"prompt": "ok", "answer": "1"}, {"prompt": None, "answer": "2"}]
    with pytest.raises(ValueError, match=r"bad.parquet row 1: missing or empty 'prompt'"):
        load_samples(_parquet(tmp_path / "bad.parquet", rows))
    with pytest.raises(ValueError, match=r"bad_ds row 3: 'answer' must be a string or a number, got nothing"):
        load_samples(_dataset_folder(tmp_path / "bad_ds", [*VERL_ROWS, {**VERL_ROWS[0], "reward_model": None}]))
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="corrupt.parquet: not a readable Parquet file"):
        load_samples(str(tmp_path / "corrupt.parquet"))


@needs_pyarrow
def test_dataset_folders(tmp_path):
    split = _dataset_folder(tmp_path / "dd" / "train", VERL_ROWS)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(ValueError, match=r"is a DatasetDict \(train\); point data.path at one split's folder"):
        load_samples(str(tmp_path / "dd"))
    assert len(load_samples(split)) == 3
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="is a folder but not a datasets save_to_disk folder"):
        load_samples(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="does not exist"):
        load_samples(str(tmp_path / "missing.parquet"))


def test_missing_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(
        ValueError,
        match=r"needs the 'pyarrow' package \(optional extra 'data'\): "
        r'pip install -e "\.\[data\]"',
    ):
        load_samples(str(path))
    assert len(load_samples(_jsonl(tmp_path / "v.jsonl", VERL_ROWS))) == 3  # JSONL needs no pyarrow


def test_row_schema_and_reader_directly(tmp_path):
    where_rows = list(read_rows(_jsonl(tmp_path / "a.jsonl", VERL_ROWS[:2])))
    assert [w for w, _ in where_rows] == [f"{tmp_path}/a.jsonl:1", f"{tmp_path}/a.jsonl:2"]
    sample = RowSchema().to_sample(where_rows[1][1], where_rows[1][0])
    assert sample.answer == "42" and sample.metadata["messages"][0]["role"] == "user"

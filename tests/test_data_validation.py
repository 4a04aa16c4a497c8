"""Data is validated when it is loaded, before step 1, and every problem names its file and
line (JSONL) or row (Parquet, Arrow, datasets folders): bytes that are not UTF-8, bad JSON,
missing or mistyped fields, and rows too long in tokens for the model's context once encoded
(chat template included), at the real 151,936-id vocabulary."""

import inspect
import json
import os
import sys

import pytest

from titanrl import train
from titanrl.config import load_config
from titanrl.data.encode import PromptEncoder, fit_demonstrations, fit_pairs, fit_prompts, fit_rows
from titanrl.data.preferences import load_preferences
from titanrl.data.prompts import held_out_split, load_samples
from titanrl.data.tasks import Sample
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import ByteTokenizer, build_tokenizer
from titanrl.recipes import rl_recipe as rl

sys.path.insert(0, os.path.dirname(__file__))
from helpers.real_vocab import write_qwen_layout_folder  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _config(path, *extra):
    return load_config([f"--data.path={path}", *extra])


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    """A tokenizer folder with Qwen2.5's layout: 151,936 ids and the ChatML template."""
    folder = tmp_path_factory.mktemp("qwen_tokenizer")
    write_qwen_layout_folder(folder)
    return folder


# ---- bytes and JSON ----


def test_non_utf8_jsonl_names_file_line_and_fix(tmp_path):
    """Non-UTF-8 byte in a JSONL data file -> ValueError naming path:line, the byte and its offset, and an iconv command"""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": 1}\n\n{"prompt": "caf\xe9 au lait?", "answer": 2}\n')
    with pytest.raises(ValueError) as e:
        load_samples(str(path))
    message = str(e.value)
    assert message.startswith(f"{path}:3: not valid UTF-8: byte 0xe9 at byte 16 of the line (file offset 46)")
    assert f"iconv -f LATIN1 -t UTF-8 {path} > converted.jsonl" in message
    # UTF-16 (PowerShell's `>`) is named as such; a UTF-8 byte-order mark is accepted.
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes('{"prompt": "ok", "answer": 1}\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=r"utf16.jsonl:1: the file is UTF-16 .* iconv -f UTF-16 -t UTF-8"):
        load_samples(str(utf16))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "ok", "answer": 1}\r\n')
    assert [s.prompt for s in load_samples(str(bom))] == ["ok"]


def test_non_utf8_preference_file_names_file_line(tmp_path):
    """Non-UTF-8 byte in a DPO / reward-model preference file -> ValueError naming path:line"""
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(
        b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n{"prompt": "p", "chosen": "\xff", "rejected": "b"}\n'
    )
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: not valid UTF-8: byte 0xff"):
        load_preferences(str(path))


def test_bad_json_line_names_file_line_and_column(tmp_path):
    """Invalid JSON line (cut short, a bare key, a JSON array file) -> ValueError naming path:line, the column and the fix"""
    cases = {
        '{"prompt": "p", "answer": 1': r"bad.jsonl:2: not valid JSON \(Expecting ',' delimiter at the end of the line: "
        r"is it cut short, or one object written over several lines\?\)",
        '{"prompt": "p", answer: 1}': r"bad.jsonl:2: not valid JSON \(Expecting property name enclosed in double "
        r"quotes at column 17\)",
    }
    for line, pattern in cases.items():
        path = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "ok", "answer": 0}', line])
        with pytest.raises(ValueError, match=pattern):
            load_samples(path)
    array = tmp_path / "rows.json"  # a JSON array file, not JSON Lines
    array.write_text('[\n  {"prompt": "p", "answer": 1}\n]\n')
    with pytest.raises(
        ValueError, match=r"rows.json:1: .* looks like one JSON array, not JSON Lines .* jq -c '\.\[\]'"
    ):
        load_samples(str(array))


def test_malformed_fields_name_file_line_and_field(tmp_path):
    """Missing field, wrong type, blank prompt, NaN answer or unpaired surrogate -> ValueError naming path:line, the field and what it holds"""
    cases = {
        '{"answer": 1}': r"bad.jsonl:2: missing or empty 'prompt': got nothing",
        '{"prompt": 7, "answer": 1}': r"bad.jsonl:2: missing or empty 'prompt': got int 7 ",
        '{"prompt": "  \\n ", "answer": 1}': r"bad.jsonl:2: missing or empty 'prompt': got str '  \\n '",
        '{"prompt": "p"}': r"bad.jsonl:2: 'answer' must be a string or a number, got nothing",
        '{"prompt": "p", "answer": NaN}': r"bad.jsonl:2: 'answer' is nan, not a finite number",
        '{"prompt": "p", "answer": {"x": "' + "y" * 500 + '"}}': r"bad.jsonl:2: 'answer' must be a string or a number, "
        r"got dict \{'x': 'y+\.\.\.$",
        '{"prompt": "ab\\ud83d", "answer": 1}': r"bad.jsonl:2: 'prompt' has an unpaired surrogate '\\ud83d' at "
        r"character 3",
        '{"prompt": [{"role": "user", "content": 5}], "answer": 1}': r"bad.jsonl:2: 'prompt' message 0 needs a "
        r"'content' string, got int 5",
    }
    for line, pattern in cases.items():
        path = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "ok", "answer": 0}', line])
        with pytest.raises(ValueError, match=pattern):
            load_samples(path)
    pairs = _jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": ["a"], "rejected": "b"}],
    )
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: missing or empty 'chosen': got list \['a'\]"):
        load_preferences(pairs)


def test_parquet_rows_are_named_by_row(tmp_path):
    """Parquet row with a missing field or a string that is not UTF-8 -> ValueError naming 'path row N' and the column"""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    missing = tmp_path / "missing.parquet"
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), str(missing))
    with pytest.raises(ValueError, match=r"missing.parquet row 1: missing or empty 'prompt': got nothing"):
        load_samples(str(missing))
    latin1 = tmp_path / "latin1.parquet"  # pyarrow checks UTF-8 on write, so bytes are relabelled as a string column
    prompts = pa.array([b"ok", b"fine", b"caf\xe9"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": prompts, "answer": ["1", "2", "3"]}), str(latin1))
    with pytest.raises(ValueError, match=r"latin1.parquet row 2: column 'prompt' is not valid UTF-8 \(byte 0xe9"):
        load_samples(str(latin1))
    pairs = tmp_path / "pairs.parquet"  # preference data reads Parquet too
    pq.write_table(pa.table({"prompt": ["p", "q"], "chosen": ["a", "b"], "rejected": ["c", None]}), str(pairs))
    with pytest.raises(ValueError, match=r"pairs.parquet row 1: missing or empty 'rejected'"):
        load_preferences(str(pairs))
    good = tmp_path / "good.parquet"  # each sample keeps its row for later checks
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), str(good))
    assert [s.where for s in load_samples(str(good))] == [f"{good} row 0", f"{good} row 1"]


# ---- rows too long for the context ----


def test_100k_char_prompt_is_named_before_any_step(tmp_path, capsys):
    """100k-character prompt -> named by file:line at start-up: dropped and counted (default) or ValueError (data.on_long_prompt='error')"""
    rows = [{"prompt": f"rev:{w}=", "answer": w[::-1]} for w in ["ab", "abc", "bca", "cab"]]
    path = _jsonl(tmp_path / "prompts.jsonl", [*rows, {"prompt": "x" * 100_000, "answer": "y"}, rows[0]])
    encode = PromptEncoder(ByteTokenizer())
    train_rows, held_out = held_out_split(load_samples(path), 2)
    kept, eval_kept = fit_prompts(_config(path, "--generator.max_new_tokens=8"), 256, encode, train_rows, held_out)
    assert len(kept) == 3 and eval_kept == held_out
    assert (
        f"dropped 1 of 6 rows whose encoded prompt is over 248 tokens (model.max_seq_len 256 - "
        f"generator.max_new_tokens 8): {path}:5 (100001 tokens)"
    ) in capsys.readouterr().out
    with pytest.raises(
        ValueError,
        match=r"prompts.jsonl:5: the encoded prompt has 100001 tokens, more than the 248 "
        r"that fit \(model.max_seq_len 256 - generator.max_new_tokens 8\); shorten",
    ):
        fit_prompts(
            _config(path, "--data.on_long_prompt=error", "--generator.max_new_tokens=8"),
            256,
            encode,
            train_rows,
            held_out,
        )
    # data.max_prompt_chars drops it at load, by characters, naming it too.
    assert len(load_samples(path, max_prompt_chars=4000)) == 5
    assert f"(4000 characters): {path}:5 (100000 characters)" in capsys.readouterr().out


@pytest.mark.skipif(
    "fit_prompts" not in inspect.getsource(rl), reason="the fit_prompts hook is not in titanrl/recipes/rl_recipe.py yet"
)
def test_overlong_prompt_fails_the_job_before_step_1(tmp_path):
    """100k-character prompt in a job's data.path, data.on_long_prompt='error' -> the job fails before step 1 naming file:line"""
    rows = [{"prompt": f"rev:{w}=", "answer": w[::-1]} for w in ["ab", "abc", "bca", "cab", "ba", "cb"]]
    path = _jsonl(tmp_path / "prompts.jsonl", [*rows[:5], {"prompt": "x" * 100_000, "answer": "y"}, rows[5]])
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
    with pytest.raises(ValueError, match=r"prompts.jsonl:6: the encoded prompt has 100001 tokens"):
        train.main(
            [
                f"--job.config_file={config}",
                f"--job.dump_folder={tmp_path / 'run'}",
                f"--data.path={path}",
                "--data.on_long_prompt=error",
                "--data.num_eval_samples=2",
                "--sft_warmup.steps=0",
                "--training.batch_size=2",
                "--reward.num_workers=1",
            ]
        )
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step (not even the step-0 eval) ran


def test_token_overlong_prompt_at_real_vocabulary_with_chat_template(tmp_path, qwen_folder, capsys):
    """Prompt under data.max_prompt_chars but over the token room after the chat template (151,936-id vocabulary) -> named by file:line with its token count"""
    tokenizer = build_tokenizer(str(qwen_folder))
    assert tokenizer.vocab_size == 151936
    questions = ["What is 6 times 7? Natalia sold clips to 48 of her friends. " * (1 + i % 3) for i in range(8)]
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": q, "answer": i} for i, q in enumerate(questions)])
    chat = ["--data.chat_template=true", f"--model.tokenizer={qwen_folder}"]
    config = _config(path, *chat, "--data.max_prompt_chars=4000")
    encode = PromptEncoder.from_config(config.data, config.model.tokenizer, tokenizer)
    samples = load_samples(path, max_prompt_chars=4000)
    sizes = [len(encode(s.prompt, s.metadata)) for s in samples]
    assert min(sizes) > len(tokenizer.encode(questions[0]))  # the template's system prompt and markers count
    # Room for exactly the middle prompts (2 copies of the text): the longest (3 copies, lines 3 and 6) are over.
    longest, room = max(sizes), sorted(set(sizes))[-2]
    max_seq_len = room + config.generator.max_new_tokens
    kept, _ = fit_prompts(config, max_seq_len, encode, samples, [])
    over = [f"{s.where} ({n} tokens)" for s, n in zip(samples, sizes) if n > room]
    assert over == [f"{path}:3 ({longest} tokens)", f"{path}:6 ({longest} tokens)"]
    assert [s.where for s in kept] == [s.where for s, n in zip(samples, sizes) if n <= room]
    out = capsys.readouterr().out
    assert f"whose encoded prompt is over {room} tokens (model.max_seq_len {max_seq_len} - " in out
    assert ", ".join(over) in out
    config = _config(path, *chat, "--data.on_long_prompt=error")
    with pytest.raises(
        ValueError,
        match=rf"chat.jsonl:3: the encoded prompt has {longest} tokens, more than the "
        rf"{room} that fit .* \(2 rows are over: .*chat.jsonl:3 .*chat.jsonl:6",
    ):
        fit_prompts(config, max_seq_len, encode, samples, [])


def test_rows_that_cannot_fit_sft_or_preference_context(tmp_path, capsys):
    """SFT row (prompt + solution) or preference pair (prompt + longer answer) over model.max_seq_len -> named by file:line at start-up"""
    encode = PromptEncoder(ByteTokenizer())
    sft = _jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": "q", "answer": "a"}, {"prompt": "q", "answer": "a" * 300}, {"prompt": "q", "answer": "b"}],
    )
    train_rows, held_out = held_out_split(load_samples(sft), 1)
    with pytest.raises(
        ValueError,
        match=r"sft.jsonl:2: the encoded prompt \+ solution has 303 tokens, more than "
        r"the 256 that fit \(model.max_seq_len 256\)",
    ):
        fit_demonstrations(_config(sft, "--data.on_long_prompt=error"), 256, encode, train_rows, held_out)
    pairs = _jsonl(
        tmp_path / "pairs.jsonl",
        [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": "b" * 300}],
    )
    kept, held = fit_pairs(_config(pairs), 256, encode, load_preferences(pairs), [])
    assert len(kept) == 1 and f"{pairs}:2 (303 tokens)" in capsys.readouterr().out
    # RL with an SFT warm-up: the warm-up's prompt + solution must fit too.
    rl_train, rl_held = fit_prompts(_config(sft, "--sft_warmup.steps=2"), 256, encode, train_rows, held_out)
    assert [s.where for s in rl_train] == [f"{sft}:3"] and "(SFT warm-up)" in capsys.readouterr().out


def test_dropping_every_row_or_a_template_error_is_a_clear_error(tmp_path):
    """Every training (or held-out) row over the token room, or a chat template rejecting a row -> ValueError naming the cause and the row"""
    path = _jsonl(
        tmp_path / "long.jsonl",
        [{"prompt": "y" * 50, "answer": 1}, {"prompt": "x" * 300, "answer": 1}, {"prompt": "ab", "answer": 1}],
    )
    encode = PromptEncoder(ByteTokenizer())
    medium, long, short = load_samples(path)
    with pytest.raises(ValueError, match=r"no training rows are left after dropping the 1 whose encoded prompt"):
        fit_prompts(_config(path), 256, encode, [long], [medium])
    with pytest.raises(ValueError, match=r"no held-out rows \(data.num_eval_samples\) are left after dropping the 1"):
        fit_prompts(_config(path, "--generator.max_new_tokens=250"), 256, encode, [short], [medium])
    train_rows = [long]
    strict = PromptEncoder(ByteTokenizer(), ChatTemplate("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(ValueError, match=r"long.jsonl:2: chat template of <string> failed: roles must alternate"):
        fit_rows(train_rows, [], lambda s: len(strict(s.prompt)), 10, "drop", "encoded prompt", "test", "fix it")
    with pytest.raises(ValueError, match=r"generator.max_new_tokens \(256\) leaves no room for a prompt"):
        fit_prompts(_config(path, "--generator.max_new_tokens=256"), 256, encode, [short], [])
    # Embedded tasks and multi-turn environments are not checked (no file rows; the env makes the first prompt).
    generated = [Sample("x" * 999, "1", "1")]
    assert fit_prompts(load_config(["--data.task=reverse"]), 256, encode, None, generated) == (None, generated)
    assert fit_prompts(_config(path, "--env.name=calculator"), 256, encode, generated, []) == (generated, [])


# ---- provenance: which rows a checkpoint was trained on ----


def test_data_identity_hashes_the_rows_read_not_the_bytes(tmp_path, capsys):
    """Data file edited, reordered or reformatted between a checkpoint and its resume -> an edit or reorder is refused naming the file and the fix, a reformat (same rows) resumes, an old checkpoint without the record resumes with one notice"""
    from titanrl.data.preferences import load_preferences
    from titanrl.data.prompts import DatasetStream, build_prompt_loader
    from titanrl.data.provenance import SOURCES_KEY, check_sources, sources_in

    rows = [{"prompt": f"rev:{w}=", "answer": w[::-1]} for w in ["ab", "abc", "bca", "cab"]]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    loader = build_prompt_loader(DatasetStream(load_samples(path), 0), 2, 0, 1)
    next(iter(loader))
    state = loader.state_dict()
    [saved] = state[SOURCES_KEY]
    assert saved["path"] == path and saved["rows"] == 4 and saved["size"] == os.path.getsize(path)
    # The same rows written with other spacing and key order: the same identity but for the size.
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(dict(reversed(r.items())), indent=None) + " \n" for r in rows))
    again = build_prompt_loader(DatasetStream(load_samples(path), 0), 2, 0, 1)
    again.load_state_dict(state)
    fresh = iter(build_prompt_loader(DatasetStream(load_samples(path), 0), 2, 0, 1))
    next(fresh)
    assert [s.prompt for s in next(iter(again))] == [s.prompt for s in next(fresh)]  # resumed where it was
    for changed in (rows[::-1], [*rows[:3], {"prompt": "rev:xy=", "answer": "yx"}]):
        _jsonl(tmp_path / "p.jsonl", changed)
        with pytest.raises(
            ValueError, match=rf"data.path '{path}' changed since the checkpoint.*--data.allow_changed=true"
        ):
            build_prompt_loader(DatasetStream(load_samples(path), 0), 2, 0, 1).load_state_dict(state)
    allowed = load_samples(path, allow_changed=True)
    check_sources(state[SOURCES_KEY], sources_in(allowed))
    assert "resuming on the new rows as data.allow_changed = true asks" in capsys.readouterr().out
    check_sources(None, sources_in(allowed))  # a checkpoint from before provenance was recorded
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "does not record the data it was trained on" in out[0]
    # Preference pairs carry their file's identity too.
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert [s.rows for s in sources_in(load_preferences(pairs))] == [1]

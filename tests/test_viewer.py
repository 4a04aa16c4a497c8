"""The rollout viewer: a real multi-turn calculator job dumps a few episodes per logged step
(metrics.dump_episodes) to episodes.jsonl, and `titanrl show` renders a step as one HTML page,
which html.parser reads back: episodes, tokens and environment tokens as the dump has them,
every run-supplied text escaped, a clear error for a folder or step with no dump."""

import contextlib
import io
import json
import os
import re
from html.parser import HTMLParser

import pytest
import torch
from helpers.tiny import smoke_run_args

from titanrl import cli, train
from titanrl.config import load_config
from titanrl.generator import Completion, Generator
from titanrl.models.tokenizer import ByteTokenizer
from titanrl.rewards.runner import RewardResult
from titanrl.rl.episode_dump import EpisodeDump, token_pieces
from titanrl.rl.groups import Rollouts

CALCULATOR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "train_configs", "grpo_calculator_debug.toml")
DUMPED = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two GRPO steps of the calculator recipe (30 SFT steps: the model calls the tool), every
    completion the generator returned recorded by its tokens: (dump folder, {tokens: [(prompt
    ids, completion)]})."""
    folder = tmp_path_factory.mktemp("calc")
    seen: dict[tuple[int, ...], list[tuple[list[int], Completion]]] = {}
    original = Generator.generate

    def recording(self, prompts, *args, **kwargs):
        completions, stats = original(self, prompts, *args, **kwargs)
        for c in completions:
            seen.setdefault(tuple(c.token_ids), []).append((prompts[c.prompt_index], c))
        return completions, stats

    args = smoke_run_args(config=CALCULATOR, steps=2, sft_steps=30, batch_size=2, max_new_tokens=20, eval_samples=1)
    args += [f"--job.dump_folder={folder}", "--env.num_workers=1", f"--metrics.dump_episodes={DUMPED}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite's processes share the cores
    try:
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
            mp.setattr(Generator, "generate", recording)
            train.main(args)
    finally:
        torch.set_num_threads(threads)
    return folder, seen


def _rows(folder) -> list[dict]:
    with open(os.path.join(folder, "episodes.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_dump_rows_are_the_generators_samples(run):
    folder, seen = run
    rows = _rows(folder)
    assert [(r["step"], r["index"]) for r in rows] == [(s, i) for s in (1, 2) for i in range(DUMPED)]
    tok = ByteTokenizer()
    env_tokens = tool_calls = 0
    for row in rows:
        # The generator's sample of these tokens: its prompt, mask (None: one model turn), logprobs.
        (prompt, c), *_ = [(p, c) for p, c in seen[tuple(row["token_ids"])] if c.logprobs == row["logprobs"]]
        assert row["model_mask"] == (c.model_mask or [1] * len(c.token_ids))
        assert row["finish_reason"] == c.finish_reason
        assert row["prompt"] == tok.decode(prompt) and row["prompt_tokens"] == len(prompt)
        assert "".join(row["pieces"]) == tok.decode(row["token_ids"])
        assert row["prompt"].endswith("? ") and row["entropies"] is None
        assert row["verifier_reward"] == pytest.approx(sum(row["turn_rewards"]))
        # Turns tile the sample: model runs and environment runs alternate, as the mask says.
        turns = row["turns"]
        assert turns[0]["start"] == 0 and turns[-1]["end"] == len(row["token_ids"])
        for turn, after in zip(turns, turns[1:]):
            assert turn["end"] == after["start"] and turn["role"] != after["role"]
        for turn in turns:
            span = row["model_mask"][turn["start"] : turn["end"]]
            assert set(span) == {1 if turn["role"] == "model" else 0}
            if turn["role"] == "env":
                env_tokens += len(span)
                assert turn["text"].startswith("<result>")
                assert all(row["logprobs"][i] == 0.0 for i in range(turn["start"], turn["end"]))
            elif call := re.fullmatch(r"<tool>([^<]*)</tool>", turn["text"]):
                assert [c["text"] for c in turn["tool_calls"]] == [call.group(1)]
                tool_calls += 1
    assert env_tokens > 0 and tool_calls > 0  # the warmed-up model called the tool


class _Page(HTMLParser):
    """Counts of a viewer page's episodes, tokens, environment tokens and any script or remote URL."""

    def __init__(self) -> None:
        super().__init__()
        self.episodes, self.tokens, self.env_tokens, self.texts, self.titles, self.bad = 0, 0, 0, [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        self.episodes += tag == "div" and "episode" in classes
        self.tokens += tag == "span" and "tok" in classes and "title" in attrs
        self.env_tokens += tag == "span" and "tok" in classes and "env" in classes and "title" in attrs
        self.titles += [attrs["title"]] if tag == "span" and "tok" in classes and "title" in attrs else []
        if tag in ("script", "link", "img", "iframe") or any(
            v and "http" in v for k, v in attrs.items() if k in ("src", "href")
        ):
            self.bad.append(tag)

    def handle_data(self, data):
        self.texts.append(data)


def _page(path) -> _Page:
    page = _Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page


def test_show_renders_each_dumped_step(run, tmp_path, capsys):
    folder, _ = run
    rows = _rows(folder)
    assert cli.main(["show", str(folder)]) == 0
    assert "episodes_step2.html" in capsys.readouterr().out
    for step, path in ((2, folder / "episodes_step2.html"), (1, tmp_path / "one.html")):
        if step == 1:
            assert cli.main(["show", str(folder), "--step", "1", "--out", str(path)]) == 0
        mine = [r for r in rows if r["step"] == step]
        page = _page(path)
        assert page.episodes == len(mine) == DUMPED and not page.bad
        assert page.tokens == sum(len(r["token_ids"]) for r in mine)
        assert page.env_tokens == sum(r["model_mask"].count(0) for r in mine) > 0
        assert f"Step {step}: {DUMPED} sampled episodes" in page.texts
        assert page.texts.count("<eos>") == sum(r["token_ids"].count(258) for r in mine)  # shown by name


def _episode(piece: str, prompt: str, failed: str) -> dict:
    return {
        "step": 5,
        "index": 0,
        "sample": 0,
        "prompt": prompt,
        "token_ids": [1, 2, 3],
        "pieces": [piece, "", "x"],
        "model_mask": [1, 0, 1],
        "logprobs": [-0.5, 0.0, -3.0],
        "entropies": [1.25, None, 0.5],
        "turns": [
            {
                "role": "model",
                "start": 0,
                "end": 1,
                "text": piece,
                "tool_calls": [{"name": "a<b", "arguments": {}, "text": piece}],
            },
            {"role": "env", "start": 1, "end": 2, "text": ""},
            {"role": "model", "start": 2, "end": 3, "text": "x", "tool_calls": [], "tool_error": "bad <call>"},
        ],
        "reward": -1.0,
        "verifier_reward": -1.0,
        "correct": False,
        "failed": failed,
        "turn_rewards": None,
        "finish_reason": "length",
    }


def test_run_text_is_escaped(tmp_path):
    """Model text, prompts, tool calls and failure reasons are shown as text, never as markup."""
    evil = '<script>alert("x")</script>&amp;'
    with open(tmp_path / "episodes.jsonl", "w") as f:
        f.write(json.dumps(_episode(evil, '<b onclick="x">', 'timeout "<i>"')) + "\n")
    assert cli.main(["show", str(tmp_path)]) == 0
    page = _page(tmp_path / "episodes_step5.html")
    assert not page.bad and page.episodes == 1 and page.tokens == 3 and page.env_tokens == 1
    assert evil in page.texts and '<b onclick="x">' in page.texts
    assert 'failed: timeout "<i>"' in page.texts and "malformed tool call: bad <call>" in page.texts
    assert f"a<b({evil})" in page.texts  # a tool call without arguments: its text
    assert page.titles == [
        "id 1 | logprob -0.500 | p 0.607 | entropy 1.250",
        "id 2 | environment token",
        "id 3 | logprob -3.000 | p 0.050 | entropy 0.500",
    ]


def test_a_redone_step_shows_its_latest_rows_and_a_torn_line_is_skipped(tmp_path):
    """A resumed run redoes the steps after its checkpoint: their rows are dumped again."""
    rows = [_episode("a", "first", None), {**_episode("b", "first", None), "index": 1}, _episode("c", "again", None)]
    with open(tmp_path / "episodes.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 6, "ind')  # a killed run's last line
    assert cli.main(["show", str(tmp_path)]) == 0
    page = _page(tmp_path / "episodes_step5.html")
    assert page.episodes == 1 and "again" in page.texts and "first" not in page.texts


def test_no_dump_or_step_is_one_clear_line(run, tmp_path, capsys):
    assert cli.main(["show", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "episodes.jsonl' not found" in line and "metrics.dump_episodes > 0" in line
    folder, _ = run
    assert cli.main(["show", str(folder), "--step", "7"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--step 7 was not dumped; the dumped steps are 1, 2" in line
    assert cli.main(["show", "--help"]) == 0
    assert "usage: titanrl show" in capsys.readouterr().out


def _rollouts(n: int) -> Rollouts:
    completions = [Completion(i // 2, i % 2, [104, 105, 258], [-0.1, -0.2, -0.3], "stop") for i in range(n)]
    results = [RewardResult(1.0, True) for _ in range(n)]
    return Rollouts([[72] for _ in range(n // 2)], completions, results, [1.0] * n)


def test_dump_chooses_spread_samples_on_logged_steps_of_rank_0(tmp_path):
    tok = ByteTokenizer()
    dump = EpisodeDump(str(tmp_path), 0, 3, 2, tok)
    assert dump.chosen(8) == [0, 2, 5] and dump.chosen(2) == [0, 1]
    dump.write(_rollouts(8), 1, 2)  # not a logged step (log_freq 2)
    assert not os.path.exists(tmp_path / "episodes.jsonl")
    dump.write(_rollouts(8), 2, 2)
    rows = _rows(tmp_path)
    assert [r["sample"] for r in rows] == [0, 2, 5] and rows[0]["pieces"] == ["h", "i", ""]
    assert rows[0]["special_tokens"] == {"258": "eos"}
    assert rows[0]["turns"] == [{"role": "model", "start": 0, "end": 3, "text": "hi"}]
    for rank, n in ((1, 3), (0, 0)):  # other ranks and dump_episodes = 0 write nothing
        EpisodeDump(str(tmp_path / f"r{rank}"), rank, n, 1, tok).write(_rollouts(4), 1, 2)
        assert not os.path.exists(tmp_path / f"r{rank}" / "episodes.jsonl")
    EpisodeDump(str(tmp_path), 0, 3, 2, tok)  # a fresh run in the folder starts the file anew
    assert not os.path.exists(tmp_path / "episodes.jsonl")


def test_token_pieces_join_to_the_text_across_split_characters():
    tok = ByteTokenizer()
    ids = tok.encode("a€<é") + [tok.eos_id]
    pieces = token_pieces(tok, ids)
    assert pieces == ["a", "", "", "€", "<", "", "é", ""] and "".join(pieces) == tok.decode(ids)


def test_negative_dump_episodes_is_a_config_error():
    with pytest.raises(ValueError, match=r"\[metrics\] dump_episodes must be >= 0"):
        load_config(["--metrics.dump_episodes=-1"])

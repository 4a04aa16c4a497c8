"""Embedded tasks, the safe expression evaluator, the reward runner's isolation, prompt data."""

import json
import math
import time

import pytest

from titanrl.data.prompts import DatasetStream, TaskStream, build_prompt_loader, load_jsonl
from titanrl.data.tasks import Arithmetic, Countdown, NumericMath, Reverse, Sort, build_task, safe_arithmetic
from titanrl.rewards.runner import RewardItem, RewardRunner


@pytest.mark.parametrize("task", [Arithmetic(), Arithmetic(ops="+-*"), Reverse(), Sort(), Countdown()])
def test_solutions_score_correct_and_garbage_does_not(task):
    for s in task.samples("train", 50, seed=0):
        score = task.score(s.solution, s.answer, s.metadata)
        assert score.correct and score.reward == pytest.approx(1.0 + task.format_weight)
        bad = task.score("###", s.answer, s.metadata)
        assert not bad.correct and bad.reward == 0.0 and not bad.well_formed


def test_arithmetic_extract_and_format_reward():
    t = Arithmetic()
    assert t.score("68", "68", {}).reward == pytest.approx(1.1)
    assert t.score(" 067 ", "68", {}).reward == pytest.approx(0.1)  # well-formed, wrong
    assert t.score("68abc", "68", {}).reward == 0.0


def test_train_and_eval_splits_differ_and_are_seeded():
    t = Arithmetic()
    assert [s.prompt for s in t.samples("eval", 20, 0)] == [s.prompt for s in t.samples("eval", 20, 0)]
    assert [s.prompt for s in t.samples("eval", 20, 0)] != [s.prompt for s in t.samples("train", 20, 0)]


def test_safe_arithmetic_never_evaluates_code():
    assert safe_arithmetic("(3+5)*7-2") == (54, [3, 5, 7, 2])
    for expr in ["__import__('os')", "2**100000", "a+1", "[1,2]", "1/0", "x" * 100]:
        with pytest.raises((ValueError, SyntaxError)):
            safe_arithmetic(expr)


def test_countdown_checks_number_usage():
    t = Countdown()
    meta = {"numbers": [3, 5, 7], "target": 22}
    assert t.score("3*5+7", "22", meta).correct
    assert not t.score("5*5-3", "22", meta).correct  # 5 used twice
    assert not t.score("3*5+8-1", "22", meta).correct  # numbers not given


def test_numeric_math_verifier():
    t = NumericMath()
    assert t.score("so she has 1,234 apples #### 1234", "1234", {}).correct
    assert t.score("first 3 then 18", "18", {}).correct
    assert not t.score("no number", "18", {}).well_formed


def test_unknown_task_is_clear():
    with pytest.raises(ValueError, match="Unknown task 'arithmatic'"):
        build_task("arithmatic")


# ---- reward isolation ----


def _raises(prompt, completion, metadata):
    if completion == "boom":
        raise RuntimeError("user bug")
    return 1.0


def _hangs(prompt, completion, metadata):
    if completion == "hang":
        time.sleep(60)
    return 0.5


def _returns(prompt, completion, metadata):
    return {"nan": math.nan, "str": "high", "inf": math.inf}.get(completion, 2.0)


def _greedy(prompt, completion, metadata):
    if completion == "big":
        blob = bytearray(4 * 2**30)  # 4 GiB: beyond the worker's memory limit
        return float(len(blob))
    if completion == "crash":
        import os

        os._exit(1)
    return 1.0


def test_reward_worker_memory_limit_and_crash_are_contained():
    """Reward function allocating 4 GiB past reward.memory_limit_mb, or killing its worker process -> that sample fails (counted: 'memory' / 'crash'), the worker is replaced, other samples are scored"""
    items = [RewardItem("p", c, "a") for c in ("ok", "big", "ok")]
    runner = RewardRunner(_greedy, num_workers=1, timeout_s=20.0, failure_reward=-1.0, memory_limit_mb=512)
    out = runner(items)
    assert [r.failed for r in out] == [None, "memory", None]
    out = runner([RewardItem("p", c, "a") for c in ("ok", "crash")])
    assert out[1].failed == "crash" and out[1].reward == -1.0
    assert [r.reward for r in runner([RewardItem("p", "ok", "a")])] == [1.0]  # a new worker took over
    runner.close()


def test_reward_runner_isolates_failures():
    """Reward function raises, hangs past the batch's timeout, or returns NaN / inf / a string -> that sample gets the failure reward and is counted; a hung worker is replaced"""
    items = lambda *cs: [RewardItem("p", c, "a") for c in cs]  # noqa: E731
    runner = RewardRunner(_raises, num_workers=2, timeout_s=10.0, failure_reward=-1.0)
    out = runner(items("ok", "boom", "ok"))
    assert [r.reward for r in out] == [1.0, -1.0, 1.0] and [r.failed for r in out] == [None, "error", None]
    runner.close()

    runner = RewardRunner(_hangs, num_workers=2, timeout_s=1.0, failure_reward=-1.0)
    start = time.monotonic()
    out = runner(items("a", "hang", "b", "c"))
    assert time.monotonic() - start < 20
    assert [r.failed for r in out] == [None, "timeout", None, None]
    assert [r.reward for r in out] == [0.5, -1.0, 0.5, 0.5]
    assert [r.reward for r in runner(items("d"))] == [0.5]  # a fresh worker replaced the hung one
    runner.close()

    runner = RewardRunner(_returns, num_workers=1, timeout_s=10.0, failure_reward=0.0)
    out = runner(items("nan", "str", "inf", "fine"))
    assert [r.failed for r in out] == ["invalid", "invalid", "invalid", None]
    assert [r.reward for r in out] == [0.0, 0.0, 0.0, 2.0]
    runner.close()


# ---- prompt data ----


def test_jsonl_loader_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2, "level": 1})
        + "\n\n"
        + json.dumps({"prompt": "x", "answer": "y"})
        + "\n"
    )
    rows = load_jsonl(str(good))
    assert [(r.prompt, r.answer, r.metadata) for r in rows] == [("1+1=", "2", {"level": 1}), ("x", "y", {})]
    cases = {
        '{"answer": 1}': r"bad.jsonl:1: missing or empty 'prompt'",
        '{"prompt": "p", "answer": [1]}': r"bad.jsonl:1: 'answer' must be a string or a number",
        "{not json": r"bad.jsonl:1: not valid JSON",
        "[1, 2]": r"bad.jsonl:1: expected a JSON object",
    }
    for text, pattern in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(ValueError, match=pattern):
            load_jsonl(str(bad))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="has no rows"):
        load_jsonl(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl(str(tmp_path / "missing.jsonl"))


def test_prompt_loader_shards_by_dp_rank_and_restores_state():
    stream = TaskStream(Arithmetic(), seed=3)
    full = build_prompt_loader(stream, 8, 0, 1)
    it = iter(full)
    global_batches = [next(it) for _ in range(3)]
    shards = [iter(build_prompt_loader(stream, 8, r, 2)) for r in range(2)]
    for batch in global_batches:
        got = [next(s) for s in shards]
        assert sorted(s.prompt for s in got[0] + got[1]) == sorted(s.prompt for s in batch)
        assert not {s.prompt for s in got[0]} & {s.prompt for s in got[1]} or len({s.prompt for s in batch}) < 8
    # Checkpointable: a loader restored from state continues where the first left off.
    loader = build_prompt_loader(stream, 8, 0, 1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = next(it)
    restored = build_prompt_loader(stream, 8, 0, 1)
    restored.load_state_dict(state)
    assert [s.prompt for s in next(iter(restored))] == [s.prompt for s in expected]
    with pytest.raises(ValueError, match="divisible by the 3 data-parallel ranks"):
        build_prompt_loader(stream, 8, 0, 3)


def test_dataset_stream_reshuffles_each_epoch():
    rows = [type("S", (), {"prompt": str(i)})() for i in range(5)]
    it = iter(DatasetStream(rows, seed=0))
    epoch1 = [next(it).prompt for _ in range(5)]
    epoch2 = [next(it).prompt for _ in range(5)]
    assert sorted(epoch1) == sorted(epoch2) == [str(i) for i in range(5)]
    with pytest.raises(ValueError, match="empty"):
        DatasetStream([], 0)

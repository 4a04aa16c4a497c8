"""The `short_answer` task of the SmolLM2 recipe: disjoint train / held-out facts, the reward
ladder (exact answer > answer among fewer words > answer in a sentence > wrong), and its
registration as an embedded task."""

import random

import pytest

from titanrl.data.short_answer import ShortAnswer, normalize
from titanrl.data.tasks import build_task


def test_train_and_held_out_facts_are_disjoint_and_held_out_rows_are_unique():
    task = ShortAnswer()
    train = {q for q, _, _ in task.splits["train"]}
    held_out = task.samples("eval", 1000, seed=0)
    assert len(held_out) == len(task.splits["eval"]) == len({s.prompt for s in held_out})
    assert not train & {s.prompt for s in held_out}
    assert {s.metadata["data_source"] for s in held_out} == {"capital", "opposite", "next"}
    drawn = task.samples("train", 200, seed=0)
    assert {s.prompt for s in drawn} <= train
    assert task.samples("eval", 5, seed=0) == held_out[:5]  # a fixed order: the same rows every eval


@pytest.mark.parametrize(
    ("reply", "reward", "correct"),
    [
        ("Rome", 1.0, True),
        ("rome.", 1.0, True),
        ("  The Rome!", 1.0, True),
        ("Rome, Italy", 0.75, False),
        ("The capital of Italy is Rome.", 0.5 * (1 + 1 / 5), False),
        ("Romeo", 0.0, False),
        ("Paris", 0.0, False),
        ("", 0.0, False),
    ],
)
def test_reward_ladder(reply, reward, correct):
    score = ShortAnswer().score(reply, "Rome", {})
    assert score.reward == pytest.approx(reward) and score.correct is correct


def test_multi_word_answers_and_normalisation():
    task = ShortAnswer()
    assert normalize("The New-Delhi.") == "new delhi"
    assert task.score("New Delhi", "New Delhi", {}).correct
    assert task.score("It is New Delhi", "New Delhi", {}).reward == pytest.approx(0.5 * (1 + 2 / 4))
    assert task.score("Delhi", "New Delhi", {}).reward == 0.0


def test_registered_and_seeded():
    task = build_task("short_answer")
    a = [task.make(random.Random(3)).prompt for _ in range(3)]
    b = [task.make(random.Random(3)).prompt for _ in range(3)]
    assert a == b and all(p.endswith(".") for p in a)

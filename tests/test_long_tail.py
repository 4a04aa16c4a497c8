"""The long tail: partial rollouts (the generator pauses unfinished samples and resumes them under
new weights; the RL recipe carries paused groups across steps), streaming rewards, and one-step
off-policy training on disaggregated rollout and trainer ranks."""

import pytest
import torch
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, ResumedSample, SamplingParams
from titanrl.models import Transformer
from titanrl.models.logprobs import token_logprobs

ARGS = tiny_model_args()


def _model(seed: int) -> Transformer:
    model = tiny_model(ARGS, seed)
    return model.eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]


def _resumed(completions) -> list[ResumedSample]:
    return [
        ResumedSample(c.prompt_index, c.sample_index, c.key, c.token_ids, c.logprobs)
        for c in completions
        if c.finish_reason == "paused" and c.token_ids
    ]


def _teacher_forced(model: Transformer, prompt: list[int], tokens: list[int]) -> list[float]:
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(seq[:, :-1])
    return token_logprobs(logits, seq[:, 1:])[0, len(prompt) - 1 :].tolist()


def _pause_after(passes: int):
    calls = []

    def pause_when(finished, stats):
        calls.append(len(finished))
        return len(calls) >= passes

    return pause_when


@pytest.mark.parametrize(
    "tokens, logprobs, message",
    [
        ([], [], "needs its tokens and their logprobs"),
        ([3, 4], [-1.0], "needs its tokens and their logprobs"),
        (list(range(90)), [-1.0] * 90, "already fills the model context"),
    ],
)
def test_a_malformed_resumed_sample_is_a_clear_error(tokens, logprobs, message):
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=64), torch.device("cpu"))
    gen.load_weights(_model(0))
    with pytest.raises(ValueError, match=message):
        gen.generate(
            _prompts([6]), SamplingParams(max_new_tokens=4, n=2), resume=[ResumedSample(0, 1, 7, tokens, logprobs)]
        )


@pytest.mark.parametrize("compile", [False, True])  # compiled: FlexAttention in the decode step
def test_pause_and_resume_with_the_same_weights_is_the_uninterrupted_run(compile):
    """Sampled at temperature 1: the resumed samples continue their random streams, so the
    tokens are those of one uninterrupted call (logprobs to float noise of a new batch)."""
    model = _model(0)
    config = GeneratorConfig(block_size=4, num_blocks=128, decode_steps_per_schedule=4, compile=compile)
    gen = Generator(ARGS, config, torch.device("cpu"))
    gen.load_weights(model)
    prompts = _prompts([5, 9, 14])
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=3, seed=7)
    full, _ = gen.generate(prompts, params)
    first, stats = gen.generate(prompts, params, pause_when=_pause_after(3))
    assert stats.paused > 0
    finished = {(c.prompt_index, c.sample_index): c for c in first if c.finish_reason != "paused"}
    rest, _ = gen.generate(prompts, params, resume=_resumed(first))
    finished.update({(c.prompt_index, c.sample_index): c for c in rest})
    assert sorted(finished) == [(c.prompt_index, c.sample_index) for c in full]
    for c in full:
        r = finished[(c.prompt_index, c.sample_index)]
        assert r.token_ids == c.token_ids and r.finish_reason == c.finish_reason
        assert max(abs(a - b) for a, b in zip(r.logprobs, c.logprobs)) < 1e-5
    gen.allocator.check_invariants()


def test_resumed_sample_behaviour_logprobs_are_those_of_the_weights_that_sampled_each_token():
    """Paused under weights A, resumed under weights B: each token's logprob is the one of the
    weights that sampled it (teacher-forced forward of A for the first part, B for the rest)."""
    a, b = _model(0), _model(1)
    gen = Generator(
        ARGS, GeneratorConfig(block_size=4, num_blocks=256, decode_steps_per_schedule=4), torch.device("cpu")
    )
    gen.load_weights(a)
    prompts = _prompts([6, 11])
    params = SamplingParams(max_new_tokens=30, temperature=1.0, n=2, seed=3)
    first, _ = gen.generate(prompts, params, pause_when=_pause_after(2))
    resumed = _resumed(first)
    assert resumed, "nothing was paused"
    cut = {(r.prompt_index, r.sample_index): len(r.token_ids) for r in resumed}
    gen.load_weights(b)
    rest, _ = gen.generate(prompts, params, resume=resumed)
    assert [(c.prompt_index, c.sample_index) for c in rest] == sorted(cut)
    for c in rest:
        k, prompt = cut[(c.prompt_index, c.sample_index)], prompts[c.prompt_index]
        assert len(c.token_ids) > k and len(c.logprobs) == len(c.token_ids)
        under_a = _teacher_forced(a, prompt, c.token_ids)
        under_b = _teacher_forced(b, prompt, c.token_ids)
        assert max(abs(x - y) for x, y in zip(c.logprobs[:k], under_a[:k])) < 1e-5
        assert max(abs(x - y) for x, y in zip(c.logprobs[k:], under_b[k:])) < 1e-5
        # The two policies really differ on these tokens (the test could not pass by accident).
        assert max(abs(x - y) for x, y in zip(under_a, under_b)) > 1e-2


def test_a_group_paused_before_its_prefill_comes_back_empty():
    model = _model(0)
    # Room for one sequence at a time: the second group waits, and is paused unstarted.
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256, max_num_seqs=2), torch.device("cpu"))
    gen.load_weights(model)
    prompts = _prompts([5, 9])
    out, stats = gen.generate(
        prompts, SamplingParams(max_new_tokens=20, temperature=0, n=2), pause_when=_pause_after(1)
    )
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.finish_reason == "paused" for c in out)
    assert all(c.token_ids for c in out[:2]) and not any(c.token_ids for c in out[2:])
    assert stats.paused == 4
    gen.allocator.check_invariants()
    assert all(rc == 0 for rc in gen.allocator.ref_count)


def test_on_finish_reports_each_sample_once_while_others_decode():
    model = _model(0)
    gen = Generator(
        ARGS, GeneratorConfig(block_size=4, num_blocks=256, decode_steps_per_schedule=4), torch.device("cpu")
    )
    gen.load_weights(model)
    prompts = _prompts([5, 9, 14])
    # Stop ids give samples of different lengths.
    params = SamplingParams(max_new_tokens=40, temperature=1.0, n=4, seed=2, stop_token_ids=list(range(0, 100, 9)))
    reports = []
    out, _ = gen.generate(prompts, params, on_finish=lambda cs: reports.append(cs))
    reported = [c for r in reports for c in r]
    assert sorted((c.prompt_index, c.sample_index, tuple(c.token_ids)) for c in reported) == [
        (c.prompt_index, c.sample_index, tuple(c.token_ids)) for c in out
    ]
    first = next(i for i, r in enumerate(reports) if r)
    assert sum(len(r) for r in reports[: first + 1]) < len(out)  # the first finished before the last
    assert len({len(c.token_ids) for c in out}) > 3


def test_streaming_rewards_train_like_batch_scoring(tmp_path):
    """reward.streaming on (scored as samples finish) vs off (scored after generation) -> every step's rewards and updates identical"""
    import json
    import os

    from helpers.launch import REPO_ROOT

    from titanrl import train

    def run(folder, streaming):
        args = [
            f"--job.config_file={os.path.join(REPO_ROOT, 'train_configs', 'grpo_reverse_debug.toml')}",
            "--sft_warmup.steps=3",
            "--sft_warmup.batch_size=8",
            "--training.batch_size=4",
            "--algorithm.group_size=4",
            "--generator.max_new_tokens=10",
            "--data.num_eval_samples=8",
            "--metrics.eval_freq=0",
            "--training.steps=3",
            f"--job.dump_folder={folder}",
            f"--reward.streaming={str(streaming).lower()}",
        ]
        train.main(args)  # in this process: no interpreter start-up
        rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        return [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]

    keys = ["reward_mean", "accuracy", "response_len", "entropy", "grad_norm", "response_len_max"]
    on, off = run(tmp_path / "on", True), run(tmp_path / "off", False)
    assert len(on) == 3 and any(r["reward_std"] > 0 for r in on)  # rewards differ between samples
    assert [{k: r[k] for k in keys} for r in on] == [{k: r[k] for k in keys} for r in off]


def test_partial_rollouts_staleness_bound_restarts_old_groups(tmp_path):
    """rollout.max_staleness = 1 with a small per-step token budget -> groups in flight too long are restarted (counted) and no trained sample has a token more than 1 version old"""
    import json
    import os

    from helpers.launch import REPO_ROOT

    from titanrl import train

    args = [
        f"--job.config_file={os.path.join(REPO_ROOT, 'train_configs', 'grpo_reverse_debug.toml')}",
        "--sft_warmup.steps=3",
        "--sft_warmup.batch_size=8",
        "--training.batch_size=4",
        "--algorithm.group_size=4",
        "--generator.max_new_tokens=12",
        "--data.num_eval_samples=8",
        "--metrics.eval_freq=0",
        "--training.steps=5",
        f"--job.dump_folder={tmp_path}",
        "--rollout.partial=true",
        "--algorithm.off_policy_correction=tis",
        "--rollout.max_step_tokens=40",
        "--rollout.max_staleness=1",
    ]
    train.main(args)  # in this process: no interpreter start-up
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    assert len(steps) == 5
    assert max(r["version_lag_max"] for r in steps) == 1  # reached, never exceeded
    assert sum(r["restarted_groups"] for r in steps) > 0


def _one_step_args(folder, *extra):
    from helpers.tiny import smoke_run_args

    return smoke_run_args(f"--job.dump_folder={folder}", *extra, steps=4, sft_steps=3)


def _rl_steps(folder) -> dict[int, dict]:
    import json

    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    return {r["step"]: r for r in rows if r.get("phase") == "rl" and "reward_mean" in r}


def _run_ok(args, nproc):
    import os

    from helpers.launch import run_cmd, train_cmd

    proc = run_cmd(train_cmd(args, nproc), {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.multirank
def test_one_step_with_staleness_0_on_1_plus_1_ranks_is_the_synchronous_run(tmp_path):
    """rollout.mode = 'one_step' on 1 rollout + 1 trainer rank with staleness 0 (the rollout rank waits for each step's weights) -> every step's rewards, lengths, entropy and grad norm equal a synchronous 1-rank run's; the weights crossed between processes are the trainer's exactly"""
    _run_ok(_one_step_args(tmp_path / "sync"), 1)
    _run_ok(_one_step_args(tmp_path / "one_step", "--rollout.mode=one_step", "--rollout.staleness=0"), 2)
    a, b = _rl_steps(tmp_path / "one_step"), _rl_steps(tmp_path / "sync")
    keys = ["reward_mean", "accuracy", "response_len", "entropy", "grad_norm", "gen_logprob_diff"]
    assert sorted(a) == [1, 2, 3, 4] and any(b[s]["grad_norm"] > 0 for s in b)
    assert [{k: a[s][k] for k in keys} for s in a] == [{k: b[s][k] for k in keys} for s in a]
    assert all(a[s]["version_lag_max"] == 0 for s in a)


@pytest.mark.multirank
def test_one_step_on_2_plus_2_ranks_trains_one_version_behind(tmp_path):
    """rollout.mode = 'one_step' on 2 rollout + 2 trainer ranks (FSDP2 over the trainer half) with staleness 1 -> batch 1 is on the initial weights, every later batch exactly one version behind; the sampler/trainer mismatch that staleness causes is measured and corrected (tis)"""
    _run_ok(
        _one_step_args(
            tmp_path,
            "--rollout.mode=one_step",
            "--rollout.rollout_ranks=2",
            "--algorithm.off_policy_correction=tis",
            "--parallelism.dp_shard=-1",
        ),
        4,
    )
    steps = _rl_steps(tmp_path)
    assert sorted(steps) == [1, 2, 3, 4]
    assert [steps[s]["version_lag_max"] for s in range(1, 5)] == [0, 1, 1, 1]
    assert steps[1]["gen_logprob_diff"] < 1e-5 < min(steps[s]["gen_logprob_diff"] for s in (2, 3, 4))
    assert all(r["rollout_generate_s"] > 0 for r in steps.values())


def test_one_step_world_must_split_in_two_halves(tmp_path, capsys):
    from helpers.launch import train_in_process

    args = _one_step_args(
        tmp_path, "--rollout.mode=one_step", "--rollout.rollout_ranks=2", "--algorithm.off_policy_correction=tis"
    )
    proc = train_in_process(args, capsys)  # a user error before any step: this process will do
    assert proc.returncode == 2 and "needs 4 ranks (2 generate, 2 train), got 1" in proc.stderr

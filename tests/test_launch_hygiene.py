"""Launch and process hygiene through the real CLI (`titanrl run`, torchrun): one-line user
errors, ranks dying with the launcher, the dump-folder lock, SIGTERM -> checkpoint -> exit 0,
torchrun restarts, stragglers. Each test's docstring is a row of the table in docs/reliability.md."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.checkpoint_runs import BASE, assert_same_weights, ok, same, steps
from helpers.launch import REPO_ROOT, cli_in_process, run_cmd
from helpers.launch import alive as _alive

from titanrl.components.containment import descendants as _descendants

DEBUG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")


def _env(fault=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO_ROOT, "tests")}
    env.pop("TITANRL_FAULT", None)
    if fault:
        env["TITANRL_FAULT"] = fault
    return env


def _titanrl(*args):
    return [sys.executable, "-m", "titanrl.cli", "run", *args]


def _metrics_rows(folder):
    path = os.path.join(folder, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _wait_for(predicate, timeout_s, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} early:\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.1)
    pytest.fail("timed out waiting")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stpes=3"], "Did you mean 'steps'"),
        (["--nproc", "3", DEBUG, "--parallelism.tp=2"], "does not divide the world size 3"),
        (["--data.path=/nonexistent.jsonl"], "/nonexistent.jsonl"),
        (["--reward.function=helpers.reward_fns:no_such_function"], "helpers.reward_fns:no_such_function"),
        (["--data.path={latin1}"], "latin1.jsonl:2: not valid UTF-8"),
        (["--distillation.teacher_hf_checkpoint=/nonexistent_teacher"], "No config.json in '/nonexistent_teacher'"),
    ],
)
def test_launcher_user_error_is_one_line_and_exit_2(tmp_path, args, message, capsys):
    """Config typo, impossible degrees, missing data file, non-UTF-8 data, unimportable reward function or missing distillation teacher, launched with `titanrl run` -> exit 2 and one line on stderr before any rank starts (plain torchrun added its 33-line ChildFailedError block and exit 1)"""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "rev:ab=", "answer": "ba"}\n{"prompt": "caf\xe9", "answer": "x"}\n')
    args = [a.format(latin1=latin1) for a in args]
    cmd = _titanrl(*args) if args[0] == "--nproc" else _titanrl(DEBUG, *args)
    if args[0].startswith("--training."):  # a fresh launcher process: nothing else reaches stderr
        proc = run_cmd(cmd, _env(), timeout_s=120)
    else:  # the launcher's pre-flight in this process (an interpreter start-up is seconds)
        proc = cli_in_process(cmd[3:], capsys)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titanrl: error:") and message in lines[0], proc.stderr


@pytest.mark.multirank
def test_second_run_is_locked_out_and_killed_launcher_leaves_no_process(tmp_path):
    """A second run started into the dump folder of a running job; then the launcher of the first is SIGKILLed -> the second exits 2 naming the holder's pid and host; within 10 s no process of the first run is left (ranks die with torchrun, reward workers with their rank)"""
    folder = tmp_path / "run"
    first = subprocess.Popen(
        _titanrl(
            "--nproc",
            "2",
            DEBUG,
            f"--job.dump_folder={folder}",
            "--training.steps=200",
            "--metrics.eval_freq=0",
            "--sft_warmup.steps=1",
            "--training.batch_size=4",
            "--algorithm.group_size=2",
            "--generator.max_new_tokens=4",
            "--reward.num_workers=1",
        ),
        env=_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: any(r.get("phase") == "rl" for r in _metrics_rows(folder)), 240, first)
        second = run_cmd(_titanrl(DEBUG, f"--job.dump_folder={folder}"), _env(), timeout_s=120)
        assert second.returncode == 2, second.stderr
        assert "is in use by pid" in second.stderr and "on host" in second.stderr, second.stderr
        # Plain torchrun (no launcher check): rank 0 refuses the folder itself.
        plain = run_cmd(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=1",
                "-m",
                "titanrl.train",
                f"--job.config_file={DEBUG}",
                f"--job.dump_folder={folder}",
            ],
            _env(),
            timeout_s=120,
        )
        assert plain.returncode != 0 and "is in use by pid" in plain.stderr
        processes = _descendants(first.pid)
        assert len(processes) >= 3  # two ranks and at least one reward worker
        os.killpg(first.pid, signal.SIGKILL)  # the launcher's group; torchrun put the ranks in sessions of their own
        first.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in processes):
            time.sleep(0.2)
        assert not [p for p in processes if _alive(p)]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()


@pytest.mark.multirank
def test_sigterm_checkpoints_exits_0_and_resumes_bit_exactly(tmp_path, uninterrupted_two_ranks):
    """SIGTERM to `titanrl run` during step 3 of a 2-rank run (as Slurm preemption or Kubernetes does); rank 1 made 2 s slow in step 3 -> the step finishes, checkpoint step-3 is saved, exit code 0; the same command resumes and every step's metrics and the final weights equal an uninterrupted run; step 3's metrics name rank 1 as the straggler in 'generate'; each step is logged once"""
    args = [a for a in BASE if not a.startswith("--job.config_file")]
    cmd = _titanrl(
        "--nproc", "2", DEBUG, *args, "--training.steps=4", f"--job.dump_folder={tmp_path}", "--parallelism.dp_shard=2"
    )
    proc = subprocess.Popen(
        cmd, env=_env("slow_generate:3:1"), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for(lambda: any(r.get("step") == 2 and "reward_mean" in r for r in _metrics_rows(tmp_path)), 300, proc)
    time.sleep(1.0)  # past step 2's checkpoint, into rank 1's slow step 3
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    # Normally step 3; under heavy load the signal can still land in step 2 (then nothing new is saved).
    stopped = json.load(open(tmp_path / "stopped.json"))["step"]
    assert f"stopped by SIGTERM after step {stopped}" in err and stopped in (2, 3), err
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-3"][: stopped - 1]
    resumed = ok(run_cmd(cmd, _env("slow_generate:3:1"), timeout_s=300))
    assert "resumed from" in resumed.stdout and f"step-{stopped}" in resumed.stdout
    (step3,) = [r for r in _metrics_rows(tmp_path) if r.get("step") == 3 and "reward_mean" in r]
    assert step3["straggler_rank"] == 1 and step3["straggler_phase"] == "generate"
    assert step3["straggler_excess_s"] > 1.5
    rl_steps = [r["step"] for r in _metrics_rows(tmp_path) if r.get("phase") == "rl" and "reward_mean" in r]
    assert rl_steps == [1, 2, 3, 4]
    same(steps(tmp_path), steps(uninterrupted_two_ranks), [1, 2, 3, 4])
    assert_same_weights(tmp_path, uninterrupted_two_ranks)


@pytest.mark.multirank
def test_torchrun_max_restarts_resumes_like_uninterrupted(tmp_path, uninterrupted_two_ranks):
    """kill -9 of rank 1 after step 3's update, under `torchrun --max-restarts=1` -> torchrun restarts both ranks, they resume from step-2 and finish; metrics (each step once) and final weights bit-identical to an uninterrupted run"""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "-m",
        "titanrl.train",
        *BASE,
        "--training.steps=4",
        f"--job.dump_folder={tmp_path}",
        "--parallelism.dp_shard=2",
    ]
    out = ok(run_cmd(cmd, _env("step:3:1"), timeout_s=600))
    assert "resumed from" in out.stdout and "step-2" in out.stdout
    rl_steps = [r["step"] for r in _metrics_rows(tmp_path) if r.get("phase") == "rl" and "reward_mean" in r]
    assert rl_steps == [1, 2, 3, 4]
    same(steps(tmp_path), steps(uninterrupted_two_ranks), [1, 2, 3, 4])
    assert_same_weights(tmp_path, uninterrupted_two_ranks)


def test_killed_launcher_leaves_no_process_the_reward_code_started(tmp_path):
    """Reward function leaving a plain child, a `setsid` child and a double-forked daemon per sample; the first run ends normally, the second's launcher process group (`titanrl run`) is SIGKILLed mid-run -> 0 of those processes alive after either (before: all of them, re-parented to PID 1)"""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**_env(), "TITANRL_TEST_PID_DIR": str(pid_dir)}
    args = [
        DEBUG,
        "--reward.function=helpers.contained_fns:spawns",
        "--sft_warmup.steps=1",
        "--training.batch_size=2",
        "--algorithm.group_size=2",
        "--generator.max_new_tokens=4",
        "--reward.num_workers=1",
        "--metrics.eval_freq=0",
        "--data.num_eval_samples=2",
    ]
    try:
        ok(run_cmd(_titanrl(*args, f"--job.dump_folder={tmp_path / 'ends'}", "--training.steps=1"), env, 300))
        assert _spawned_alive(pid_dir, expect=0, timeout_s=10) == 0
        for name in os.listdir(pid_dir):
            os.remove(pid_dir / name)
        folder = tmp_path / "killed"
        run = subprocess.Popen(
            _titanrl(*args, f"--job.dump_folder={folder}", "--training.steps=200"),
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_for(lambda: len(_recorded(pid_dir)) >= 6, 240, run)
            assert _spawned_alive(pid_dir, expect=len(_recorded(pid_dir)), timeout_s=0) > 0
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        assert _spawned_alive(pid_dir, expect=0, timeout_s=10) == 0
    finally:
        for pid in _recorded(pid_dir):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _recorded(pid_dir) -> list[int]:
    """Pids the reward code recorded (tests/helpers/contained_fns.py), whatever their kind."""
    return [int(line.split()[1]) for name in os.listdir(pid_dir) for line in open(os.path.join(pid_dir, name))]


def _stat(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read()
    except OSError:  # exited meanwhile
        return ""


def _spawned_alive(pid_dir, expect: int, timeout_s: float) -> int:
    """How many recorded `sleep`s are alive once `expect` are, or after `timeout_s`."""

    def count():
        return sum(_alive(p) and "(sleep)" in _stat(p) for p in _recorded(pid_dir))

    deadline = time.monotonic() + timeout_s
    while count() != expect and time.monotonic() < deadline:
        time.sleep(0.1)
    return count()

"""The reward runner's isolation: whatever a reward function does to its worker process fails that
sample alone, with a counted reason, in bounded time; plus one real run under torchrun.

The runner is built directly (workers are plain interpreters, ~50 ms to start); the reward
functions are in tests/helpers/reward_fns.py. Each fault test's docstring is a row of the table
in docs/reliability.md ('<fault> -> <observed behaviour>').
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import contained_fns, reward_fns
from helpers.launch import REPO_ROOT, run_cmd
from helpers.tiny import smoke_run_args

from titanrl.components.containment import probe
from titanrl.rewards.runner import OUTPUT_KEEP_BYTES, RewardItem, RewardOutputLog, RewardRunner


def _items(*completions, **metadata):
    return [RewardItem("p", c, "a", dict(metadata)) for c in completions]


def _pids(runner):
    return [w.proc.pid for w in runner.pool.slots]


def _live_in_group(pgid):
    """Pids of the processes in process group `pgid` that have not exited (zombies excluded)."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(entry))
    return live


def _wait_gone(pgid, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while _live_in_group(pgid) and time.monotonic() < end:
        time.sleep(0.05)
    return _live_in_group(pgid)


def test_user_code_raising_base_exceptions_fails_only_that_sample():
    """Reward function raising SystemExit, KeyboardInterrupt or GeneratorExit -> that sample fails ('error', the exception named in its detail); the worker lives on and the batch's other samples are scored"""
    runner = RewardRunner(reward_fns.misbehaves, num_workers=1, timeout_s=20.0, failure_reward=-1.0)
    try:
        out = runner(_items("ok", "system_exit", "ok", "keyboard_interrupt", "generator_exit", "ok"))
        pids = _pids(runner)
        assert [r.failed for r in out] == [None, "error", None, "error", "error", None]
        assert [r.reward for r in out] == [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
        assert "SystemExit: 3" in out[1].detail and "KeyboardInterrupt" in out[3].detail
        assert "GeneratorExit" in out[4].detail
        assert [r.reward for r in runner(_items("ok"))] == [1.0] and _pids(runner) == pids  # the same worker
    finally:
        runner.close()


def test_worker_deaths_fail_only_their_sample():
    """Reward function calling os._exit, segfaulting, SIGKILLing its worker, or allocating past reward.memory_limit_mb -> that sample fails ('crash' with the exit code or signal, or 'memory'); a new worker takes over and the batch's other samples are scored"""
    runner = RewardRunner(
        reward_fns.misbehaves, num_workers=1, timeout_s=30.0, failure_reward=-1.0, memory_limit_mb=256
    )
    try:
        out = runner(_items("ok", "exit", "ok", "segfault", "ok", "sigkill", "ok", "memory", "ok"))
        assert [r.failed for r in out] == [None, "crash", None, "crash", None, "crash", None, "memory", None]
        assert [r.reward for r in out] == [1.0, -1.0] * 4 + [1.0]
        assert "exited with code 7" in out[1].detail
        assert "SIGSEGV" in out[3].detail and "Segmentation fault" in out[3].output  # faulthandler's report
        assert "SIGKILL" in out[5].detail
        assert "MemoryError" in out[7].detail
    finally:
        runner.close()


def test_hung_samples_cost_one_deadline_per_batch():
    """16 hung reward calls in one batch with reward.timeout_s = 2 -> the batch ends at its deadline (< 6 s, not 16 timeouts in a row); unfinished samples fail ('timeout'), the others are scored, only the hung workers are replaced"""
    runner = RewardRunner(reward_fns.hangs, num_workers=2, timeout_s=2.0, failure_reward=-1.0)
    try:
        start = time.monotonic()
        out = runner(_items(*["hang"] * 16))
        elapsed = time.monotonic() - start
        assert [r.failed for r in out] == ["timeout"] * 16 and elapsed < 6, elapsed

        runner.close()
        runner = RewardRunner(reward_fns.hangs, num_workers=3, timeout_s=2.0, failure_reward=-1.0)
        runner(_items("ok"))
        idle = _pids(runner)
        out = runner(_items("ok", "hang", "ok", "ok", "hang", "ok", "ok"))
        assert [r.failed for r in out] == [None, "timeout", None, None, "timeout", None, None]
        assert [r.reward for r in out] == [1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0]
        assert len(set(idle) & set(_pids(runner))) == 1  # the one worker not hung was kept
        assert [r.reward for r in runner(_items("ok", "ok", "ok"))] == [1.0] * 3
    finally:
        runner.close()


def test_function_killing_every_worker_is_bounded():
    """Reward function that ends its worker process on every sample, batch of 32 -> each worker slot is restarted once per batch, then the remaining samples fail ('crash') at once: the batch takes well under a second here (bound asserted: 10 s), not a respawn per sample"""
    runner = RewardRunner(reward_fns.exits_process, num_workers=2, timeout_s=60.0, failure_reward=-1.0)
    try:
        for _ in range(2):  # and the next batch starts with fresh workers
            start = time.monotonic()
            out = runner(_items(*["x"] * 32))
            elapsed = time.monotonic() - start
            assert [r.failed for r in out] == ["crash"] * 32 and elapsed < 10, elapsed
            ran = [r for r in out if "exited with code 7" in r.detail]
            assert len(ran) == 4  # two workers, each slot restarted once
            assert all("not run" in r.detail for r in out if r not in ran)
    finally:
        runner.close()


def test_forked_processes_die_with_their_worker(tmp_path):
    """Reward function forking processes (a bounded fork bomb: children with grandchildren), then killing its worker or returning -> nothing it forked survives its worker (the worker's process group is killed when the worker dies, is replaced or the runner closes)"""
    runner = RewardRunner(reward_fns.misbehaves, num_workers=1, timeout_s=30.0, failure_reward=-1.0)
    try:
        for then, expected in (("exit", "crash"), ("return", None)):
            pid_file = tmp_path / f"{then}.pids"
            out = runner(_items("fork", "ok", children=4, pid_file=str(pid_file), then=then))
            assert [r.failed for r in out] == [expected, None]
            pgid, *children = map(int, pid_file.read_text().split())
            assert len(children) == 4
            if then == "return":  # they live with their worker, until it goes
                assert len(_live_in_group(pgid)) >= 1 + 4
                runner.close()
            assert _wait_gone(pgid) == []
    finally:
        runner.close()


def test_output_flood_is_captured_and_capped(capfd):
    """Reward function printing 10 MB per sample (from Python and from a child process) -> the trainer's console stays clean; each sample keeps the first 4 kB of its output and counts the rest as dropped"""
    runner = RewardRunner(reward_fns.misbehaves, num_workers=2, timeout_s=30.0, failure_reward=-1.0)
    try:
        size = 10_000_000
        out = runner(_items("print", "ok", "print", bytes=size))
        assert [r.reward for r in out] == [1.0, 1.0, 1.0]
        for r in (out[0], out[2]):
            assert len(r.output) == OUTPUT_KEEP_BYTES and set(r.output) <= set("pec")
            assert r.output_dropped == size - OUTPUT_KEEP_BYTES
        assert out[1].output == "" and out[1].output_dropped == 0
        captured = capfd.readouterr()
        assert captured.out == "" and captured.err == ""
        log = RewardOutputLog.format("step 1", out)
        assert f"=== step 1 sample 0: reward 1, {size - OUTPUT_KEEP_BYTES} bytes of output dropped" in log
        assert "sample 1" not in log and len(log) < 2 * (OUTPUT_KEEP_BYTES + 200)
    finally:
        runner.close()


def test_function_that_cannot_load_in_a_worker_is_a_clear_error(tmp_path, monkeypatch):
    """Reward function whose module fails to import in the worker processes -> the first batch raises RuntimeError with the worker's exit and output (the import's traceback), no worker is left behind"""
    (tmp_path / "loads_only_here.py").write_text(
        "import os\n"
        "if os.getpid() != int(os.environ['TRAINER_PID']):\n"
        "    print('no licence in this process')\n"
        "    raise ImportError('needs the trainer')\n"
        "def fn(prompt, completion, metadata):\n"
        "    return 1.0\n"
    )
    monkeypatch.setenv("TRAINER_PID", str(os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))
    import loads_only_here

    runner = RewardRunner(loads_only_here.fn, num_workers=2, timeout_s=10.0, failure_reward=-1.0)
    pids = _pids(runner)
    with pytest.raises(RuntimeError, match="cannot be loaded in a worker process") as error:
        runner(_items("ok"))
    assert "no licence in this process" in str(error.value) and "ImportError: needs the trainer" in str(error.value)
    assert all(_wait_gone(pid) == [] for pid in pids)  # each led its own process group


CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")


def test_reward_function_raising_system_exit_in_a_real_run(tmp_path):
    """User reward function doing `raise SystemExit` in a real run under torchrun -> the run finishes (exit 0); every sample fails ('error'), counted in reward_failures and eval_reward_failures; the traceback goes to reward_output.log, not the console"""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "titanrl.train",
        *smoke_run_args(
            f"--job.dump_folder={tmp_path}",
            "--reward.function=helpers.reward_fns:raises_system_exit",
            config=CONFIG,
            steps=2,
            sft_steps=2,
        ),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO_ROOT, "tests")}
    env.pop("TITANRL_FAULT", None)
    proc = run_cmd(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    assert len(steps) == 2
    assert all(r["reward_failures"] == 16 and r["reward_failures_error"] == 16 for r in steps)
    assert [r["eval_reward_failures"] for r in rows if "eval_reward_failures" in r] == [8, 8]
    log = (tmp_path / "reward_output.log").read_text()
    assert "=== step 2 sample 15: failed (error)" in log and "\nSystemExit\n" in log
    assert "SystemExit" not in proc.stdout + proc.stderr


def test_worker_module_imports_no_torch():
    # A worker (and a replacement for a dead one) starts in the time its imports take: the
    # worker's module must stay free of torch and of titanrl modules that import it.
    code = "import sys, titanrl.rewards.worker; print('torch' in sys.modules)"
    proc = run_cmd([sys.executable, "-c", code], {**os.environ})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_streamed_batch_scores_like_one_call():
    """Items submitted in pieces (begin / submit / poll / finish, as the generator finishes samples) -> the same results, in submission order, as one call; a hung one times out at finish's deadline, counted from finish"""
    runner = RewardRunner(reward_fns.hangs, num_workers=2, timeout_s=2.0, failure_reward=-1.0)
    try:
        whole = runner(_items("a", "hang", "b", "c"))
        runner.begin()
        runner.submit(_items("a", "hang"))
        time.sleep(0.5)
        runner.poll()
        runner.submit(_items("b", "c"))
        start = time.monotonic()
        streamed = runner.finish()
        waited = time.monotonic() - start
        assert [(r.reward, r.failed) for r in streamed] == [(r.reward, r.failed) for r in whole]
        assert [r.failed for r in streamed] == [None, "timeout", None, None]
        assert 1.5 < waited < 10.0  # the deadline runs from finish(), not from the first submit
        assert runner(_items("d")) and all(w is not None for w in runner.pool.slots)  # replaced, usable
    finally:
        runner.close()


# ---- containment: nothing the reward code starts outlives its worker ----

CGROUPS = "cgroup" in probe()
MODES = [pytest.param("cgroup", marks=pytest.mark.skipif(not CGROUPS, reason="no writable cgroup here")), "subreaper"]


def _spawned(pid_dir):
    """{'plain' | 'setsid' | 'daemon': [pids]} the reward code recorded in `pid_dir`."""
    found = {}
    for name in os.listdir(pid_dir):
        for line in open(os.path.join(pid_dir, name)):
            kind, pid = line.split()
            found.setdefault(kind, []).append(int(pid))
    return found


def _sleep_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return "(sleep)" in stat and stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _left_alive(pid_dir, timeout_s=10.0):
    pids = [p for ps in _spawned(pid_dir).values() for p in ps]
    end = time.monotonic() + timeout_s
    while any(_sleep_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [p for p in pids if _sleep_alive(p)]


def _all_alive(pid_dir, timeout_s=5.0):
    """Every recorded process alive (a daemon may still be between its fork and its exec)?"""
    pids = [p for ps in _spawned(pid_dir).values() for p in ps]
    end = time.monotonic() + timeout_s
    while not all(_sleep_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return len(pids) == 12 and all(_sleep_alive(p) for p in pids)


def _kill_leftovers(pid_dir):
    for pids in _spawned(pid_dir).values() if os.path.isdir(pid_dir) else []:
        for pid in pids:
            if _sleep_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pid_dir(tmp_path, monkeypatch, request):
    folder = tmp_path / "pids"
    folder.mkdir()
    monkeypatch.setenv("TITANRL_TEST_PID_DIR", str(folder))
    if getattr(request, "param", "cgroup") == "subreaper":
        monkeypatch.setenv("TITANRL_NO_CGROUPS", "1")
    yield str(folder)
    _kill_leftovers(str(folder))


@pytest.mark.parametrize("pid_dir", MODES, indirect=True)
def test_spawned_children_setsid_and_daemons_die_with_the_workers(pid_dir):
    """Reward code leaving a plain child, a `setsid` child and a double-forked daemon per sample; the worker replaced, then the runner closed -> 0 of them alive (cgroup: killed with the worker's cgroup; subreaper fallback: re-parented to the worker's keeper and killed from /proc)"""
    runner = RewardRunner(contained_fns.spawns, num_workers=2, timeout_s=30.0, failure_reward=-1.0)
    try:
        assert [r.failed for r in runner(_items(*["x"] * 4))] == [None] * 4
        spawned = _spawned(pid_dir)
        assert {k: len(v) for k, v in spawned.items()} == {"plain": 4, "setsid": 4, "daemon": 4}
        assert _all_alive(pid_dir)  # they live with their worker
        # The samples went to whichever worker was free (2 + 2 on an idle machine, not always):
        # what each worker's code started, by the worker's pid (the reward code's pid files).
        keeper = runner.pool.slots[0].proc.pid
        with open(f"/proc/{keeper}/task/{keeper}/children") as f:
            killed = {f"{pid}.pids" for pid in f.read().split()}  # its worker (and orphans it reaped)
        by_worker = {
            name: [int(line.split()[1]) for line in open(os.path.join(pid_dir, name))] for name in os.listdir(pid_dir)
        }
        others = [pid for name, pids in by_worker.items() if name not in killed for pid in pids]
        runner.pool.slots[0].kill()  # a worker killed (as at a deadline): what it started goes with it
        runner.pool.slots[0] = None
        pids = [p for ps in by_worker.values() for p in ps]
        end = time.monotonic() + 10
        while sum(map(_sleep_alive, pids)) != len(others) and time.monotonic() < end:
            time.sleep(0.05)
        assert sum(map(_sleep_alive, pids)) == len(others) and all(map(_sleep_alive, others))  # the other worker's
        runner.close()
        assert _left_alive(pid_dir) == []
    finally:
        runner.close()


_TRAINER = (
    "import sys; from helpers import contained_fns; from titanrl.rewards.runner import RewardItem, RewardRunner\n"
    "runner = RewardRunner(contained_fns.spawns, num_workers=2, timeout_s=30.0, failure_reward=-1.0)\n"
    "print([r.failed for r in runner([RewardItem('p', 'c', 'a')] * 4)], flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.parametrize("pid_dir", MODES, indirect=True)
def test_spawned_processes_die_when_the_trainer_is_sigkilled(pid_dir):
    """A trainer process SIGKILLed while its reward workers' code has left plain, `setsid` and double-forked `sleep`s running -> 0 of them alive within 10 s (the keepers' parent-death signal)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")])}
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout.readline().startswith("reward workers contained by")
        assert trainer.stdout.readline().strip() == "[None, None, None, None]"
        assert _all_alive(pid_dir)
        trainer.kill()
        trainer.wait()
        assert _left_alive(pid_dir) == []
    finally:
        trainer.kill()
        trainer.wait()


def test_leaking_function_fails_only_the_samples_over_the_limit():
    """Reward function keeping 100 MB more per call, reward.memory_limit_mb = 250, 9 samples on one worker -> only every third sample fails ('memory'): the worker that raised MemoryError is replaced, so what it leaked fails no later sample"""
    runner = RewardRunner(contained_fns.leaks, num_workers=1, timeout_s=60.0, failure_reward=-1.0, memory_limit_mb=250)
    try:
        out = runner(_items(*["x"] * 9, mb=100))
        assert [r.failed for r in out] == [None, None, "memory"] * 3
        assert all("MemoryError" in r.detail for r in out if r.failed)
    finally:
        runner.close()


@pytest.mark.skipif("memory" not in probe(), reason="no cgroup memory controller here")
def test_worker_tree_over_its_memory_limit_is_killed_and_replaced():
    """Reward code whose child holds 90 MB while the worker takes 270 MB, reward.memory_limit_mb = 300 (each under its own address-space limit, the tree over its cgroup's memory limit) -> the kernel kills the worker; that sample fails ('memory', not 'crash'), a fresh worker scores the next"""
    runner = RewardRunner(
        contained_fns.tree_hog, num_workers=1, timeout_s=60.0, failure_reward=-1.0, memory_limit_mb=300
    )
    try:
        out = runner(_items("x", mb=270, child_mb=90))
        assert [r.failed for r in out] == ["memory"], out
        assert "crossed its memory limit" in out[0].detail
        assert [r.failed for r in runner(_items("x", mb=10, child_mb=10))] == [None]
    finally:
        runner.close()

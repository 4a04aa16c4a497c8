"""Fault tolerance across replica groups with TorchFT (`[fault_tolerance]`, `titanrl run
--ft-replicas N`): each test's docstring is one row of the table in docs/reliability.md."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import background
from helpers.launch import REPO_ROOT, alive, torchrun_cmd
from helpers.tiny import smoke_run_args
from safetensors.torch import load_file

from titanrl.components.containment import descendants
from titanrl.components.ft_launch import free_port, lighthouse_cmd, replica_args

pytest.importorskip("torchft")

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("TITANRL_FAULT", None)


def _args(*extra, steps=4):
    return smoke_run_args("--checkpoint.export_hf=true", *extra, config=None, steps=steps, sft_steps=3)


def _rows(folder) -> list[dict]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if r.get("phase") == "rl" and "reward_mean" in r]


def _weights(folder):
    return load_file(os.path.join(folder, "hf", "model.safetensors"))


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


EQUAL = "tests/test_fault_tolerance.py::test_two_replica_groups_equal_a_dp_replicate_2_run"
# Both runs in the background from collection on (helpers/background.py). min_replicas = 2: no step
# without both groups (with 1, a group that starts late would heal into the run instead).
background.register(
    "ft_two_groups",
    (EQUAL,),
    lambda folder: [
        *[sys.executable, "-m", "titanrl.cli", "run", "--ft-replicas", "2", CONFIG],
        *_args(f"--job.dump_folder={folder}", "--fault_tolerance.min_replicas=2"),
    ],
)
background.register(
    "ft_dp_replicate",
    (EQUAL,),
    lambda folder: [
        *[*torchrun_cmd(2), "-m", "titanrl.train", f"--job.config_file={CONFIG}"],
        *_args(f"--job.dump_folder={folder}", "--parallelism.dp_replicate=2"),
    ],
)


def _launched(name):
    proc, folder = background.result(name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


@pytest.mark.multirank
def test_two_replica_groups_equal_a_dp_replicate_2_run():
    """`titanrl run --ft-replicas 2` (lighthouse + 2 replica groups of 1 rank), no failure -> every step's grad norm and rewards equal a 2-rank dp_replicate = 2 run's to float rounding, the final weights within 1e-5, and both replica groups hold bitwise the same weights"""
    ft, ref = _launched("ft_two_groups"), _launched("ft_dp_replicate")
    r0, r1, dp = _rows(ft / "replica_0"), _rows(ft / "replica_1"), _rows(ref)
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == [r["step"] for r in dp] == [1, 2, 3, 4]
    assert all(r["ft_quorum"] == 2 for r in r0 + r1)
    for a, b, c in zip(r0, r1, dp):
        assert a["grad_norm"] == b["grad_norm"] and abs(a["grad_norm"] - c["grad_norm"]) <= 1e-6 * max(
            1, c["grad_norm"]
        )
        assert (a["reward_mean"] + b["reward_mean"]) / 2 == pytest.approx(c["reward_mean"], abs=1e-7)
    assert _max_diff(_weights(ft / "replica_0"), _weights(ft / "replica_1")) == 0.0
    assert _max_diff(_weights(ft / "replica_0"), _weights(ref)) < 1e-5


class ReplicaGroups:
    """A lighthouse and replica groups of one rank each, started and restarted by the test (as
    a cluster's scheduler would), each in `folder/replica_<i>`; killed at the end."""

    def __init__(self, folder, replicas, steps, *extra, nproc=1):
        self.folder, self.replicas, self.steps, self.extra, self.nproc = folder, replicas, steps, extra, nproc
        self.port = free_port()
        # A 2 s heartbeat timeout (5 s by default): the tests wait less for a group to be dropped.
        self.lighthouse = subprocess.Popen(
            lighthouse_cmd(self.port, 1, heartbeat_timeout_ms=2000),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, r, fault=None):
        args = [f"--job.config_file={CONFIG}", *_args(*self.extra, steps=self.steps)]
        args = replica_args(args, str(self.folder), r, self.replicas, f"http://localhost:{self.port}")
        env = {**ENV, **({"TITANRL_FAULT": fault} if fault else {})}
        log = open(self.folder / f"replica_{r}.log", "a")
        self.procs[r] = subprocess.Popen(
            [*torchrun_cmd(self.nproc), "-m", "titanrl.train", *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def rows(self, r):
        return _rows(self.folder / f"replica_{r}")

    def wait_for(self, predicate, timeout_s=240):
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "timed out: " + open(self.folder / "replica_0.log").read()[-3000:]
            time.sleep(0.2)

    def close(self):
        for p in [*self.procs.values(), self.lighthouse]:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def groups(tmp_path):
    made = []

    def make(*args, **kwargs):
        made.append(ReplicaGroups(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.mark.multirank
def test_kill_9_of_a_replica_group_the_other_trains_on_and_the_restarted_one_heals(groups):
    """[fault_tolerance], 2 replica groups of 2 FSDP2 ranks: kill -9 of group 1's rank 1 after step 3 -> group 0 logs every step without a restart, with quorum 1 while group 1 is down; group 1 started again heals from group 0's live state (each rank its shards; no checkpoint read) in a measured time, trains in lockstep, and both end with bitwise identical weights"""
    g = groups(2, 45, "--parallelism.dp_shard=2", nproc=2)
    g.start(0)
    g.start(1, fault="step:3:1")
    assert g.procs[1].wait(timeout=300) != 0  # killed
    # Started again at once, as a scheduler would; it takes longer to start than group 0 to go on alone.
    g.start(1)
    assert g.procs[0].wait(timeout=300) == 0 and g.procs[1].wait(timeout=300) == 0
    r0, r1 = g.rows(0), g.rows(1)
    assert [r["step"] for r in r0] == list(range(1, 46))  # every step once: group 0 never restarted
    quorum = [r["ft_quorum"] for r in r0]
    assert 1 in quorum and quorum[:3] == [2, 2, 2] and quorum[-1] == 2
    healed = [r for r in r1 if r["ft_heal_s"] > 0]
    assert len(healed) == 1 and healed[0]["step"] > 4  # joined the run where it was, not at step 4
    assert [r["step"] for r in r1][-1] == 45
    assert _max_diff(_weights(g.folder / "replica_0"), _weights(g.folder / "replica_1")) == 0.0
    alone = [r for r in r0 if r["ft_quorum"] == 1]
    print(
        f"group 0 alone for steps {alone[0]['step']}-{alone[-1]['step']}; group 1 healed in {healed[0]['ft_heal_s']:.3f} s"
    )


@pytest.mark.multirank
def test_a_stopped_replica_group_is_dropped_and_readmitted_after_sigcont(groups):
    """[fault_tolerance], 2 replica groups: SIGSTOP of group 1's rank (hung, not dead) -> after the heartbeat timeout group 0 goes on with quorum 1; after SIGCONT group 1 finds its step failed, rejoins the quorum, heals from group 0 and both end with bitwise identical weights"""
    g = groups(2, 30, "--fault_tolerance.timeout_s=3")
    g.start(0)
    g.start(1)
    g.wait_for(lambda: len(g.rows(1)) >= 3)
    (rank,) = [p for p in descendants(g.procs[1].pid) if b"titanrl.train" in open(f"/proc/{p}/cmdline", "rb").read()]
    os.kill(rank, signal.SIGSTOP)
    try:
        g.wait_for(lambda: [r["ft_quorum"] for r in g.rows(0)][-3:] == [1.0, 1.0, 1.0])
    finally:
        os.kill(rank, signal.SIGCONT)
    assert g.procs[0].wait(timeout=300) == 0 and g.procs[1].wait(timeout=300) == 0
    r0, r1 = g.rows(0), g.rows(1)
    assert [r["step"] for r in r0] == list(range(1, 31)) and r0[-1]["ft_quorum"] == 2
    assert any(r["ft_heal_s"] > 0 for r in r1) and r1[-1]["step"] == 30
    assert _max_diff(_weights(g.folder / "replica_0"), _weights(g.folder / "replica_1")) == 0.0


@pytest.mark.multirank
def test_killed_ft_launcher_leaves_no_process(tmp_path):
    """`titanrl run --ft-replicas 2` SIGKILLed mid-run (the launcher process alone) -> the lighthouse, both torchruns and their ranks are gone within seconds (each dies with its parent)"""
    args = _args(f"--job.dump_folder={tmp_path}", steps=200)
    cmd = [sys.executable, "-m", "titanrl.cli", "run", "--ft-replicas", "2", CONFIG, *args]
    run = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (_rows(tmp_path / "replica_0") and _rows(tmp_path / "replica_1")):
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        started = descendants(run.pid)
        assert len(started) >= 5  # the lighthouse, 2 torchruns, 2 ranks (and reward workers)
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 15
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in started if alive(p)] == []
    finally:
        for pid in [run.pid, *descendants(run.pid)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

"""`titanrl run --ft-replicas N`: the TorchFT lighthouse and N replica groups on this machine.

Each replica group is its own torchrun job (the torchrun options given, e.g. --nproc and
--max-restarts, apply to each), with `[fault_tolerance]` set: its replica_id, the group count, the
lighthouse's address, and its own dump folder `<job.dump_folder>/replica_<i>`; replica group 0
writes the checkpoints. On a cluster the same layout is one scheduler job per replica group plus
one lighthouse (scripts/deploy/), each restarted on its own. Every process started here dies with
this launcher (SIGKILL on the parent's death), and the ranks die with their torchrun.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from titanrl.components.console import get_logger

log = get_logger(__name__)

HEARTBEAT_TIMEOUT_MS = 5000
"""A replica group silent this long is out of the next quorum (dead, hung or stopped)."""
JOIN_TIMEOUT_MS = 60000
"""How long a quorum waits for the groups that heartbeat but have not asked for it yet."""


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def lighthouse_cmd(port: int, min_replicas: int, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> list[str]:
    exe = shutil.which("torchft_lighthouse")
    if exe is None:
        raise ValueError("--ft-replicas needs TorchFT's lighthouse (torchft_lighthouse): pip install torchft")
    return [
        exe,
        f"--min_replicas={min_replicas}",
        f"--bind=[::]:{port}",
        f"--heartbeat_timeout_ms={heartbeat_timeout_ms}",
        f"--join_timeout_ms={JOIN_TIMEOUT_MS}",
    ]


def replica_args(config_args: list[str], dump_folder: str, replica: int, replicas: int, lighthouse: str) -> list[str]:
    """The job's arguments for replica group `replica`."""
    args = [
        *config_args,
        "--fault_tolerance.enable=true",
        f"--fault_tolerance.replica_id={replica}",
        f"--fault_tolerance.group_size={replicas}",
        f"--fault_tolerance.lighthouse={lighthouse}",
        f"--job.dump_folder={os.path.join(dump_folder, f'replica_{replica}')}",
    ]
    return args if replica == 0 else [*args, "--checkpoint.enable=false"]  # one group checkpoints


def run_replica_groups(
    torchrun_opts: list[str], config_args: list[str], dump_folder: str, replicas: int, min_replicas: int
) -> int:
    """Start the lighthouse and `replicas` torchrun jobs, wait for the jobs; the worst exit code."""
    port = free_port()
    lighthouse = subprocess.Popen(lighthouse_cmd(port, min_replicas), preexec_fn=_die_with_parent)
    address = f"http://localhost:{port}"
    log.info(f"titanrl: TorchFT lighthouse at {address}; {replicas} replica groups in {dump_folder}/replica_*")
    groups = []
    try:
        for r in range(replicas):
            args = replica_args(config_args, dump_folder, r, replicas, address)
            cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_opts, "-m", "titanrl.train", *args]
            groups.append(subprocess.Popen(cmd, preexec_fn=_die_with_parent))
        codes = [g.wait() for g in groups]
    finally:
        for p in [*groups, lighthouse]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in [*groups, lighthouse]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    for r, code in failed:
        log.error(f"titanrl: replica group {r} exited with code {code} (its output is above)")
    return failed[0][1] if failed else 0

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_torchrun(script: str, nproc: int, args: list[str], timeout_s: float = 600) -> str:
    """Run `script` under `torchrun --standalone` with `nproc` gloo ranks; fail with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"torchrun {os.path.basename(script)} exited {proc.returncode}:\n{output[-6000:]}")
    return output

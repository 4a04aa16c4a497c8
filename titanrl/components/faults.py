"""Fault injection for tests: `TITANRL_FAULT='<where>:<step>:<rank>'` names one place in one
rank's run where it kills itself (kill -9 tests) or misbehaves (a poisoned update, a hang)."""

import os

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def fault_active(where: str, step: int) -> bool:
    """Fault-injection hook for tests: TITANRL_FAULT='<where>:<step>:<rank>' names one place."""
    spec = os.environ.get("TITANRL_FAULT")
    # Only the first launch: workers that torchrun restarts (--max-restarts) inherit the variable.
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return False
    target_where, target_step, target_rank = spec.split(":")
    return where == target_where and step == int(target_step) and _rank() == int(target_rank)


def fault_point(where: str, step: int) -> None:
    """SIGKILL this rank here if TITANRL_FAULT names this place (kill -9 tests)."""
    if fault_active(where, step):
        os.kill(os.getpid(), 9)

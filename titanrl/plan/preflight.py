"""`titanrl run`'s memory check ([preflight] plan): the job's plan on the launch's world size,
made in the launcher before torchrun starts a rank; a job that cannot fit is refused with the
plan's one-line reason."""

import torch

from titanrl.components.console import get_logger
from titanrl.config.job_config import JobConfig
from titanrl.plan.activations import Workload
from titanrl.plan.memory import GIB, plan_job
from titanrl.plan.report import overflow_fix

log = get_logger(__name__)

AUTO_MIN_RANKS = 9
"""[preflight] plan = 'auto' plans launches of this many ranks or more."""


def local_device_bytes(config: JobConfig) -> int | None:
    """preflight.device_memory_gb, else this machine's first GPU's memory; None without either."""
    if config.preflight.device_memory_gb:
        return int(config.preflight.device_memory_gb * GIB)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def check_plan(config: JobConfig, world: int) -> None:
    """ValueError (one line) when the job's mesh cannot be built or its peak does not fit."""
    p = config.preflight
    if p.plan == "off" or (p.plan == "auto" and world < AUTO_MIN_RANKS):
        return
    device = local_device_bytes(config)
    if device is None:
        log.info("[preflight] plan skipped: no GPU here to size it by; set preflight.device_memory_gb")
        return
    plan = plan_job(config, world, device, Workload(p.prompt_tokens, config.generator.max_new_tokens))
    if not plan.fits():
        raise ValueError(
            f"[preflight] the job does not fit {world} devices of {device / GIB:.1f} GiB: {overflow_fix(plan, config)} "
            f"(`titanrl plan {config.job.config_file} --world {world}` shows every component; "
            "--preflight.plan=off skips this check)"
        )

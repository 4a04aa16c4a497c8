"""`titanrl plan CONFIG --world N [--gpu NAME|GiB] [--prompt-tokens P] [--suggest] [--section.key=value ...]`:
the job's memory per rank by component on N devices, whether it fits, and what to change.

Exit codes: 0 it fits; 1 it builds but does not fit (the report, then one line naming the
component that overflows and the fix); 2 the mesh or the parallel plan cannot be built, or the
config is wrong (one line naming the constraint and its fix).
"""

import argparse
import time

from titanrl.config.job_config import JobConfig
from titanrl.plan.memory import GIB, GPUS, RESERVED_BYTES, JobPlan, RankPlan, device_bytes, plan_job
from titanrl.plan.ranks import ModelBytes

USAGE = "titanrl plan CONFIG.toml --world N [--gpu h100-80gb|h200-141gb|b200-192gb|GiB] [--section.key=value ...]"

HELP = """Plan the job's memory on N devices in this one CPU process: the real mesh and the real
parallelised models (policy, reference, critic, reward model, the generator's copy) built on
the meta device under torch's fake process group, for the first and the last rank (the largest
and the smallest shards). Prints each component's bytes per rank, the KV pool, the update's
activations (an analytic model: titanrl/plan/activations.py) and the headroom. Exit code 0: it
fits; 1: it does not (the last line says what to change); 2: it cannot be built (one line)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titanrl plan", usage=USAGE, description=HELP)
    parser.add_argument("config", metavar="CONFIG.toml", help="the job's config")
    parser.add_argument("--world", type=int, required=True, metavar="N", help="ranks (devices) of the job")
    parser.add_argument("--gpu", default="h100-80gb", help=f"{', '.join(GPUS)}, or memory per device in GiB")
    parser.add_argument("--prompt-tokens", type=int, default=512, metavar="P", help="prompt length assumed per sample")
    parser.add_argument("--suggest", action="store_true", help="list the meshes that fit, fastest first")
    return parser


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def _model_rows(name: str, m: ModelBytes | None) -> list[tuple[str, str]]:
    if m is None:
        return [(name, "none")]
    rows = [(f"{name} parameters", gib(m.params))]
    if m.grads:
        rows += [(f"{name} gradients", gib(m.grads)), (f"{name} optimizer state", gib(m.optimizer))]
    return rows


def component_rows(r: RankPlan) -> list[tuple[str, str]]:
    """(component, its bytes, or 'none' / 'shared') of one rank."""
    rows = _model_rows("policy", r.policy) + [("buffers (RoPE tables)", gib(r.policy.buffers))]
    rows += _model_rows("reference", r.reference) + _model_rows("critic", r.critic)
    rows += _model_rows("reward model", r.reward_model)
    generator = "shared" if r.generator_weights is None else gib(r.generator_weights)
    rows += [("generator weights", generator), ("KV pool", gib(r.kv.bytes))]
    rows += [("update activations", gib(r.activations)), ("FSDP2 buffers (update)", gib(r.fsdp_buffers))]
    rows += [("MoE recompute kept", gib(r.recompute_kept)), ("optimizer step temps", gib(r.step_temp))]
    rows += [("generation peak", gib(r.generation_peak())), ("update peak", gib(r.update_peak()))]
    return rows


def format_plan(plan: JobPlan, config_file: str, gpu: str) -> str:
    """The report: a header, a column per rank class, a verdict."""
    degrees = " ".join(f"{k}={v}" for k, v in plan.degrees.items())
    lines = [
        f"titanrl plan: {config_file} on {plan.world} x {gpu} ({gib(plan.device_bytes)} each, "
        f"{gib(RESERVED_BYTES)} reserved for CUDA context / NCCL / allocator slack)",
        f"mesh: {degrees}; update micro-batch {plan.ranks[0].update_tokens} tokens per rank",
    ]
    header = "".join(f"{f'rank {r.rank}':>16}" for r in plan.ranks)
    lines.append(f"{'component':<26}{header}")
    table = [component_rows(r) for r in plan.ranks]
    for i, (name, _) in enumerate(table[0]):
        lines.append(f"{name:<26}{''.join(f'{rows[i][1]:>16}' for rows in table)}")
    kv = plan.ranks[0].kv
    lines.append(f"{'KV pool tokens':<26}{''.join(f'{r.kv.tokens:>16,}' for r in plan.ranks)}")
    lines.append(f"{'headroom':<26}{''.join(f'{gib(plan.usable_bytes - r.peak()):>16}' for r in plan.ranks)}")
    verdict = "fits" if plan.fits() else "does NOT fit"
    lines.append(
        f"{verdict}: peak {gib(plan.worst().peak())} of {gib(plan.usable_bytes)} usable; KV pool {kv.blocks} blocks"
    )
    return "\n".join(lines)


def overflow_fix(plan: JobPlan, config: JobConfig) -> str:
    """The one line a plan that does not fit ends with: the phase, its largest part, the fix."""
    r = plan.worst()
    over = gib(r.peak() - plan.usable_bytes)
    if r.generation_peak() >= r.update_peak():
        if config.generator.num_blocks:
            return f"generation needs {over} more: lower generator.num_blocks ({config.generator.num_blocks})"
        return f"the weights and optimizer state alone need {over} more: raise dp_shard or ep, or add ranks"
    parts = {
        "activations": r.activations,
        "recomputed MoE activations kept to the next forward": r.recompute_kept,
        "optimizer state": r.policy.optimizer,
    }
    largest = max(parts, key=lambda k: parts[k])
    if largest == "optimizer state":
        fix = "raise dp_shard or ep, or add ranks"
    elif config.activation_checkpoint.mode != "full" and largest == "activations":
        fix = "set activation_checkpoint.mode = 'full'"
    else:
        fix = "lower training.micro_batch_tokens or raise tp / cp"
    return f"the update needs {over} more, {largest} first: {fix}"


def plan_main(argv: list[str]) -> int:
    """`titanrl plan ...`; the exit code (module docstring)."""
    from titanrl.algorithms import validate_algorithm
    from titanrl.components.console import get_logger
    from titanrl.config import load_config
    from titanrl.plan.activations import Workload

    log = get_logger("titanrl.plan")
    parser = build_parser()
    try:
        args, overrides = parser.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    start = time.perf_counter()
    try:
        config = load_config([f"--job.config_file={args.config}", *overrides])
        validate_algorithm(config)
        workload = Workload(args.prompt_tokens, config.generator.max_new_tokens)
        device = device_bytes(args.gpu)
        plan = plan_job(config, args.world, device, workload)
        if args.suggest:
            from titanrl.plan.suggest import format_suggestions

            print(format_suggestions(config, args.world, device, args.gpu, workload), flush=True)
    except ValueError as e:
        log.error(f"titanrl plan: error: {e}")
        return 2
    print(format_plan(plan, args.config, args.gpu), flush=True)
    print(f"planned in {time.perf_counter() - start:.1f} s", flush=True)
    if not plan.fits():
        print(f"titanrl plan: does not fit: {overflow_fix(plan, config)}", flush=True)
        return 1
    return 0

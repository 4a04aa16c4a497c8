"""`titanrl run`: check the whole job in one process, then start it under torchrun.

    titanrl run [--nproc N] [torchrun options] CONFIG.toml [--section.key=value ...]
    titanrl eval CONFIG.toml [--checkpoint PATH | --hf FOLDER] [--nproc N] [--out FILE] [--section.key=value ...]
    titanrl serve-env NAME [--host H] [--port P] [--token-file F]
    titanrl cp {rl,sft,dpo,reward_model} DEST.py
    titanrl show OUTPUT_DIR [--step N] [--out FILE]
    titanrl plan CONFIG.toml --world N [--gpu h100-80gb|h200-141gb|b200-192gb|GiB] [--suggest] [--section.key=value ...]

Everything before the .toml file goes to torchrun (`--nproc N` is `--nproc_per_node=N`; without
rendezvous options the job is `--standalone`), everything after it overrides the config. A user
error (config, degrees, data, checkpoint or model paths, reward function, a dump folder in use)
is one line on stderr and exit code 2, before any rank starts; so is a checkpoint to resume from
whose parameters do not fit the model, that the dump folder has no room to save again, or whose
data file has changed (`titanrl.data.provenance`). A user error that only a rank finds is printed
once, by this launcher; one raised during the run names <dump_folder>/errors.log, its
traceback. A run stopped by SIGTERM / SIGUSR1 that saved its checkpoint exits 0, so that
`sbatch --requeue` or a Kubernetes restart resumes it.
`torchrun -m titanrl.train --job.config_file CONFIG ...` still works; it checks the same things
on every rank, and torchrun reports a failed rank its own way. `titanrl eval` runs the config's
[[eval]] suites on a checkpoint without training (`titanrl/evaluate.py`, docs/evaluation.md).
`titanrl serve-env NAME` serves an environment over OpenEnv's protocol (`titanrl/envs/openenv_server.py`).
`titanrl cp rl my_rl.py` copies a built-in recipe and its config to fork (job.recipe names the
copy). `titanrl show OUTPUT_DIR` writes an HTML page of the episodes a run dumped (docs/viewer.md).
`titanrl --help` and `titanrl COMMAND --help` describe each command; `titanrl --version`.
"""

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from titanrl.components import viewer
from titanrl.components.console import get_logger

if TYPE_CHECKING:
    from titanrl.config import JobConfig

log = get_logger("titanrl.cli")  # not __name__: `python -m titanrl.cli` runs it as __main__

USAGE_RUN = "titanrl run [--nproc N] [torchrun options] CONFIG.toml [--section.key=value ...]"
USAGE_EVAL = (
    "titanrl eval CONFIG.toml [--checkpoint PATH | --hf FOLDER] [--nproc N] [--out FILE] [--section.key=value ...]"
)
USAGE = f"usage: {USAGE_RUN}"
RENDEZVOUS = ("--standalone", "--nnodes", "--rdzv", "--master", "--node-rank", "--node_rank")
# Slurm preemption (`--signal=USR1@90`) must reach the ranks: torchrun forwards only what it handles.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = 300  # what a rank has after the signal to finish its step and checkpoint


def split_args(args: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun options, config file, config overrides): the first *.toml argument splits them."""
    for i, arg in enumerate(args):
        if arg.endswith(".toml") and not arg.startswith("-"):
            return torchrun_options(args[:i]), arg, args[i + 1 :]
    raise ValueError(f"no CONFIG.toml given; {USAGE}")


def torchrun_options(opts: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(opts):
        if opts[i] == "--nproc":
            if i + 1 == len(opts):
                raise ValueError(f"--nproc needs a number; {USAGE}")
            out.append(f"--nproc_per_node={opts[i + 1]}")
            i += 2
            continue
        out.append(opts[i].replace("--nproc=", "--nproc_per_node=", 1) if opts[i].startswith("--nproc=") else opts[i])
        i += 1
    if not any(o.startswith(RENDEZVOUS) for o in out):
        out.append("--standalone")
    if not any(o.startswith(("--signals-to-handle", "--signals_to_handle")) for o in out):
        out.append(f"--signals-to-handle={SIGNALS}")
    if not any(o.startswith(("--shutdown-timeout", "--shutdown_timeout")) for o in out):
        out.append(f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}")
    return out


def world_size(opts: list[str]) -> int | None:
    """nproc_per_node x nnodes when both are fixed numbers; None for elastic ranges or 'gpu'."""
    values = {"--nproc_per_node": "1", "--nproc-per-node": "1", "--nnodes": "1"}
    for i, opt in enumerate(opts):
        key, eq, value = opt.partition("=")
        if key in values:
            values[key] = value if eq else (opts[i + 1] if i + 1 < len(opts) else "")
    nproc = values["--nproc_per_node"] if values["--nproc_per_node"] != "1" else values["--nproc-per-node"]
    if not (nproc.isdigit() and values["--nnodes"].isdigit()):
        return None
    return int(nproc) * int(values["--nnodes"])


def preflight(config_args: list[str], ranks: int | None) -> "JobConfig":
    """Everything a rank would reject before step 1, checked once here: the job's config, or
    ValueError on a user error."""
    from titanrl.algorithms import validate_algorithm
    from titanrl.components import launch
    from titanrl.components.plugins import load_object
    from titanrl.config import load_config
    from titanrl.distributed import ParallelDims
    from titanrl.envs.pool import resolve_env
    from titanrl.models.hf import read_hf_config
    from titanrl.models.tokenizer import build_tokenizer
    from titanrl.plan.preflight import check_plan
    from titanrl.recipes import get_recipe
    from titanrl.rl.evaluation import suite_reward

    config = load_config(config_args)
    validate_algorithm(config)
    p = config.parallelism
    if ranks is not None:
        ParallelDims(p.dp_replicate, p.dp_shard, p.tp, ranks, p.ep, p.cp)
        check_plan(config, ranks)  # [preflight] plan: the memory per rank, before any rank allocates
    data = get_recipe(config.job.recipe, config.job.config_file).load_data(config)  # a forked recipe imports
    args = launch.model_args(config, build_tokenizer(config.model.tokenizer).vocab_size)
    if config.distillation.teacher_hf_checkpoint:
        read_hf_config(config.distillation.teacher_hf_checkpoint)  # the teacher's folder exists and parses
    path = config.checkpoint.load_path.rstrip("/")
    if path and not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"checkpoint.load_path '{path}' is not a complete titanrl step-N checkpoint folder")
    if config.job.recipe == "rl" and config.reward.function:
        load_object(config.reward.function, "reward.function")
    if config.job.recipe == "rl" and config.env.name:
        if ":" in config.env.name:
            load_object(config.env.name, "env.name")  # a module that fails at import: one line naming file:line
        resolve_env(config.env.name)
    for suite in config.eval:
        suite_reward(suite, config)  # each [[eval]] suite's scorer imports
    launch.check_dump_folder_free(config.job.dump_folder)
    check_resume(config, args, data)
    return config


def check_resume(config: "JobConfig", args, data) -> None:
    """The checkpoint the ranks will resume from, if any, fits: its parameters' shapes and dtypes
    are the model's, the dump folder has room for the next save, and its data is this run's
    (`data`: the recipe's rows)."""
    from titanrl.components import launch
    from titanrl.components.checkpoint_integrity import load_host_state
    from titanrl.data.provenance import SOURCES_KEY, check_sources, sources_in

    path = launch.checkpoint_to_load(config)
    if path is None:
        return
    if config.job.recipe == "reward_model":
        args = dataclasses.replace(args, num_labels=1)
    launch.check_checkpoint_shapes(path, args, config.lora if config.lora.enable else None)
    launch.check_free_space(config, path)
    try:  # as the ranks read it (plain data, runs no code); a host state it cannot read is left to them
        loader = load_host_state(os.path.join(path, "host_rank0.pt"))["loader"]
    except Exception:
        return
    check_sources(loader.get(SOURCES_KEY), sources_in(data), notify=False)


def rank_role(config: "JobConfig", rank: int) -> str:
    """'3', or with disaggregated rollout ranks '3 (trainer rank 1)': what a failure line names."""
    R = config.rollout.rollout_ranks
    if config.rollout.mode not in ("one_step", "async"):
        return str(rank)
    return f"{rank} (rollout rank {rank})" if rank < R else f"{rank} (trainer rank {rank - R})"


def run_torchrun(
    opts: list[str],
    config_args: list[str],
    dump_folder: str,
    module: str = "titanrl.train",
    describe: Callable[[int], str] = str,
) -> int:
    """Run the job (`module` on every rank) under torchrun in this process; the exit code for the
    shell. `describe` names a rank in the failure line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from titanrl.components.launch import ERROR_DIR_ENV, STOPPED_FILE

    started = time.time()
    args = get_args_parser().parse_args([*opts, "-m", module, *config_args])
    errors = tempfile.TemporaryDirectory(prefix="titanrl-errors-")
    quiet = quiet_user_errors(errors.name)
    os.environ[ERROR_DIR_ENV] = errors.name  # the ranks inherit it: they leave their user error there
    try:
        run(args)
        return 0
    except SignalException as e:
        stopped = os.path.join(dump_folder, STOPPED_FILE)
        if os.path.exists(stopped) and os.path.getmtime(stopped) >= started:
            record = json.load(open(stopped))
            log.warning(
                f"titanrl: stopped by {record['signal']} after step {record['step']} "
                f"(checkpoint {record['checkpoint'] or 'off'})"
            )
            return 0
        log.warning(f"titanrl: stopped by signal {e.sigval.name} before a checkpoint was saved")
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        # A user error, also one a rank left while another rank failed first in another way.
        if failure.exitcode == 2 or os.listdir(errors.name):
            log.error(rank_error(errors.name, rank))
        # The watchdog (3) has already printed its one line.
        if failure.exitcode < 0:  # killed: the OOM killer, kill -9, a crash
            name = signal.Signals(-failure.exitcode).name
            log.error(f"titanrl: rank {describe(rank)} was killed by {name}; the other ranks were stopped")
        elif failure.exitcode not in (2, 3):
            log.error(f"titanrl: rank {describe(rank)} failed with exit code {failure.exitcode} (its output is above)")
        return failure.exitcode if failure.exitcode in (2, 3) else 1
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeFilter(quiet)
        errors.cleanup()


def rank_error(folder: str, rank: int) -> str:
    """The user error line that rank `rank` (else any rank) left in `folder` (`launch.report_user_error`)."""
    names = [f"rank{rank}.txt", *sorted(os.listdir(folder))]
    for name in names:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                return f.read().strip()
    return f"titanrl: error: rank {rank} stopped on a user error (exit code 2) without naming it"


class _UserErrorFilter(logging.Filter):
    """Drops torchrun's 'failed (exitcode: 2|3)' log line: a user error (2) or the watchdog (3)
    is already one line of its own, and this one only added the rank's pid and python binary.
    Once a rank has reported a user error (a file in `folder`), also its 'Sending process N
    closing signal SIGTERM' lines for the ranks it stops."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "failed (exitcode: 2)" in message or "failed (exitcode: 3)" in message:
            return False
        return not ("closing signal" in message and os.path.isdir(self.folder) and os.listdir(self.folder))


def quiet_user_errors(folder: str) -> _UserErrorFilter:
    """Filter torchrun's own log lines about a rank's user error (`remove` it after the run)."""
    found = _UserErrorFilter(folder)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(found)
    return found


def version() -> str:
    """The installed distribution's version, else the package's own (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    import titanrl

    try:
        return installed("titanrl")
    except PackageNotFoundError:
        return titanrl.__version__


RUN_HELP = """Check the whole job in this process (config, degrees, data, model and checkpoint
paths, reward function: a user error is one line and exit code 2), then start it under torchrun.
Everything before CONFIG.toml goes to torchrun (without rendezvous options the job is
--standalone); everything after it overrides the config. Every config key:
`python -m titanrl.train --help` and docs/configuration.md."""

EVAL_HELP = """Run the config's [[eval]] suites on a checkpoint without training, under torchrun,
and print the JSON summary on stdout (notices go to stderr); docs/evaluation.md."""

CP_HELP = """Copy a built-in recipe's file and a TOML config that trains it (job.recipe pointing at
the copy) to start an experiment from: `titanrl cp rl my_rl.py` writes my_rl.py and
my_rl.toml; then edit the copy and `titanrl run my_rl.toml`. Nothing is overwritten."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's own (for its --help)."""
    parser = argparse.ArgumentParser(
        prog="titanrl",
        description="titanrl: PyTorch-native RL post-training for LLMs.",
        epilog="`titanrl COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"titanrl {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="check a job, then train it under torchrun", description=RUN_HELP, usage=USAGE_RUN)
    run.add_argument("--nproc", metavar="N", help="ranks per node (torchrun's --nproc_per_node); default 1")
    run.add_argument("torchrun", nargs="*", metavar="TORCHRUN_OPTION", help="e.g. --nnodes=2 --rdzv-endpoint=H:P")
    run.add_argument("config", metavar="CONFIG.toml", help="the job's config (train_configs/)")
    run.add_argument("overrides", nargs="*", metavar="--section.key=value", help="overrides of the config's keys")
    ev = sub.add_parser(
        "eval", help="run a config's [[eval]] suites on a checkpoint", description=EVAL_HELP, usage=USAGE_EVAL
    )
    ev.add_argument("config", metavar="CONFIG.toml", help="a config with [[eval]] suites")
    ev.add_argument("--checkpoint", metavar="PATH", help="a titanrl step-N checkpoint folder")
    ev.add_argument("--hf", metavar="FOLDER", help="a Hugging Face model folder (sets model.hf_checkpoint)")
    ev.add_argument("--nproc", metavar="N", help="ranks (default 1)")
    ev.add_argument("--out", metavar="FILE", help="the JSON summary's file (default <job.dump_folder>/eval.json)")
    ev.add_argument("overrides", nargs="*", metavar="--section.key=value", help="overrides of the config's keys")
    serve = sub.add_parser("serve-env", help="serve an environment over OpenEnv's protocol", add_help=False)
    serve.add_argument("args", nargs=argparse.REMAINDER)
    cp = sub.add_parser("cp", help="copy a built-in recipe and its config to fork", description=CP_HELP)
    cp.add_argument("recipe", choices=sorted(RECIPE_CONFIGS), help="the built-in recipe to copy")
    cp.add_argument("dest", metavar="DEST.py", help="the copy's file; its config is DEST.toml beside it")
    show = sub.add_parser("show", help="write an HTML page of a run's sampled episodes", description=viewer.SHOW_HELP)
    viewer.add_show_arguments(show)
    plan = sub.add_parser("plan", help="plan a job's memory per rank on N devices, on this CPU", add_help=False)
    plan.add_argument("args", nargs=argparse.REMAINDER)
    return parser, {"run": run, "eval": ev, "serve-env": serve, "cp": cp, "show": show, "plan": plan}


RECIPE_CONFIGS = {
    "rl": "grpo_reverse_debug.toml",
    "sft": "sft_reverse_debug.toml",
    "dpo": "dpo_reverse_debug.toml",
    "reward_model": "reward_model_reverse_debug.toml",
}
"""The train_configs/ file each built-in recipe's copy starts from."""


def copy_main(args: argparse.Namespace) -> int:
    """`titanrl cp RECIPE DEST.py`: the recipe's file as DEST.py and its config as DEST.toml."""
    try:
        recipe_file, config_text = fork_sources(args.recipe)
        dest = args.dest if args.dest.endswith(".py") else args.dest + ".py"
        toml = os.path.splitext(dest)[0] + ".toml"
        for path in (dest, toml):
            if os.path.exists(path):
                raise ValueError(f"'{path}' exists; give `titanrl cp` a new file name (nothing was written)")
        with open(recipe_file) as f:
            source = f.read()
        with open(dest, "x") as f:
            f.write(source)
        with open(toml, "x") as f:
            f.write(point_at(config_text, os.path.basename(dest)))
    except (ValueError, OSError) as e:
        log.error(f"titanrl: error: {e}")
        return 2
    log.info(f"wrote {dest} (a copy of {recipe_file})")
    log.info(f"wrote {toml} (job.recipe = '{os.path.basename(dest)}'); train it with: titanrl run {toml}")
    return 0


def fork_sources(name: str) -> tuple[str, str]:
    """(the built-in recipe's source file, the text of the config its copy starts from)."""
    import inspect

    from titanrl.recipes import get_recipe

    recipe_file = inspect.getsourcefile(get_recipe(name))
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs")
    config = os.path.join(config, RECIPE_CONFIGS[name])
    if recipe_file is None or not os.path.isfile(config):
        raise ValueError(f"the '{name}' recipe's files are not in this installation ({config}); use a source checkout")
    with open(config) as f:
        return recipe_file, f.read()


def point_at(config_text: str, recipe_file: str) -> str:
    """`config_text` with [job] recipe set to `recipe_file` (a relative path: found beside the config)."""
    out = ["# A forked recipe: `titanrl cp` copied this config; job.recipe names the copy beside it.\n"]
    section, placed = "", False
    for line in config_text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
        if section == "[job]" and stripped.split("=")[0].strip() == "recipe":
            continue  # replaced below the [job] header
        out.append(line)
        if stripped == "[job]" and not placed:
            out.append(f'recipe = "{recipe_file}"\n')
            placed = True
    return "".join(out) if placed else f'[job]\nrecipe = "{recipe_file}"\n\n' + "".join(out)


def main(argv: list[str] | None = None) -> int:
    """`titanrl COMMAND ...`; the exit code for the shell. argparse reads the command and the
    top-level flags; `run` and `eval` read the rest in order (torchrun options before the .toml
    file, config overrides after it: argparse cannot keep that split for options it does not
    know), `serve-env` with its own parser (`titanrl/envs/openenv_server.py`), `cp` with argparse."""
    argv = sys.argv[1:] if argv is None else argv
    parser, commands = build_parser()
    if argv and argv[0] in IN_ORDER:
        if argv[0] not in ("serve-env", "plan") and ("-h" in argv[1:] or "--help" in argv[1:]):
            commands[argv[0]].print_help()
            return 0
        return IN_ORDER[argv[0]](argv[1:])
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (2), already printed
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 0
    return show_main(args) if args.command == "show" else copy_main(args)


def show_main(args: argparse.Namespace) -> int:
    """`titanrl show OUTPUT_DIR [--step N] [--out FILE]`: the page of a step's dumped episodes."""
    try:
        path = viewer.write_page(args.folder, args.step, args.out)
    except (ValueError, OSError) as e:
        log.error(f"titanrl: error: {e}")
        return 2
    log.info(f"wrote {path}")
    return 0


def ft_replicas(opts: list[str]) -> tuple[int, list[str]]:
    """(`--ft-replicas N`, the other torchrun options): N replica groups under TorchFT, 0: none."""
    for i, opt in enumerate(opts):
        key, eq, value = opt.partition("=")
        if key == "--ft-replicas":
            value = value if eq else (opts[i + 1] if i + 1 < len(opts) else "")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--ft-replicas needs a number of replica groups >= 1, got '{value}'")
            return int(value), opts[:i] + opts[i + (1 if eq else 2) :]
    return 0, opts


def run_main(argv: list[str]) -> int:
    """`titanrl run ...`: check the job in this process, then start it under torchrun (with
    `--ft-replicas N`: N replica groups and TorchFT's lighthouse, `components/ft_launch.py`)."""
    try:
        opts, config_file, overrides = split_args(argv)
        replicas, opts = ft_replicas(opts)
        config_args = [f"--job.config_file={config_file}", *overrides]
        ft = ["--fault_tolerance.enable=true", f"--fault_tolerance.group_size={replicas}"] if replicas else []
        config = preflight([*config_args, *ft], world_size(opts))
    except ValueError as e:
        log.error(f"titanrl: error: {e}")
        return 2
    if replicas:
        from titanrl.components.ft_launch import run_replica_groups

        dump, min_replicas = config.job.dump_folder, config.fault_tolerance.min_replicas
        return run_replica_groups(opts, config_args, dump, replicas, min_replicas)
    return run_torchrun(opts, config_args, config.job.dump_folder, describe=lambda rank: rank_role(config, rank))


def eval_main(args: list[str]) -> int:
    """`titanrl eval ...`: check, run the suites under torchrun, print the JSON summary."""
    from titanrl import evaluate

    try:
        parsed = evaluate.parse_eval_args(args)
        config = evaluate.preflight(parsed)
    except ValueError as e:
        log.error(f"titanrl: error: {e}")
        return 2
    opts = torchrun_options(["--nproc", parsed.nproc])
    code = run_torchrun(
        opts, evaluate.rank_args(parsed, config.job.dump_folder), config.job.dump_folder, "titanrl.evaluate"
    )
    if code == 0:
        with open(evaluate.out_path(parsed, config.job.dump_folder)) as f:
            print(f.read(), end="", flush=True)  # stdout is the JSON alone (`titanrl eval ... | jq`)
    return code


def serve_env_main(argv: list[str]) -> int:
    """`titanrl serve-env NAME ...`: an environment as an OpenEnv-compatible server (docs/env_servers.md)."""
    from titanrl.envs.openenv_server import serve_main

    try:
        return serve_main(argv)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)


def plan_main(argv: list[str]) -> int:
    """`titanrl plan CONFIG --world N ...`: memory per rank, whether it fits (`titanrl/plan/report.py`)."""
    from titanrl.plan.report import plan_main as main_of_plan

    return main_of_plan(argv)


IN_ORDER = {"run": run_main, "eval": eval_main, "serve-env": serve_env_main, "plan": plan_main}
"""The commands whose arguments are read in order, after argparse has read the command."""


if __name__ == "__main__":
    sys.exit(main())

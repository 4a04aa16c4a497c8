"""`titanrl eval`: the `[[eval]]` suites of a job's config on a checkpoint, without training.

    titanrl eval CONFIG.toml [--checkpoint PATH | --hf FOLDER] [--nproc N] [--out FILE] [--section.key=value ...]

`--checkpoint` loads the model of a titanrl step-N checkpoint (DCP; any number of ranks);
`--hf` a Hugging Face folder (it sets model.hf_checkpoint, and model.tokenizer when the folder
holds a tokenizer.json); neither: the
config's own model.hf_checkpoint (or a fresh init). The ranks (torchrun, `--nproc N`) split each
suite's prompts and sample them with the generator training uses; the JSON summary (each suite's
metrics, its settings, the config file, the checkpoint, the titanrl commit) goes to `--out`
(default <job.dump_folder>/eval.json) and is printed. A user error is one line on stderr and
exit code 2. Nothing of a training run in the same dump folder is touched but eval.json.

On each rank: `python -m titanrl.evaluate --out=FILE [--checkpoint=PATH] --job.config_file=...`.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

USAGE = (
    "usage: titanrl eval CONFIG.toml [--checkpoint PATH | --hf FOLDER] [--nproc N] [--out FILE] "
    "[--section.key=value ...]"
)
_OPTIONS = ("--checkpoint", "--hf", "--nproc", "--out")


@dataclass
class EvalArgs:
    config_file: str
    checkpoint: str = ""
    hf: str = ""
    nproc: str = "1"
    out: str = ""
    overrides: list[str] = field(default_factory=list)

    def config_args(self) -> list[str]:
        hf = [f"--model.hf_checkpoint={self.hf}"] if self.hf else []
        if self.hf and os.path.isfile(os.path.join(self.hf, "tokenizer.json")):
            hf.append(f"--model.tokenizer={self.hf}")
        return [f"--job.config_file={self.config_file}", *hf, *self.overrides]


def parse_eval_args(args: list[str]) -> EvalArgs:
    """The command line after `titanrl eval`; ValueError naming the problem and the usage."""
    values: dict[str, str] = {}
    rest, config_file, i = [], "", 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in _OPTIONS:
            if not eq:
                if i + 1 == len(args):
                    raise ValueError(f"{name} needs a value; {USAGE}")
                value, i = args[i + 1], i + 1
            values[name[2:]] = value
        elif not config_file and args[i].endswith(".toml") and not args[i].startswith("-"):
            config_file = args[i]
        else:
            rest.append(args[i])
        i += 1
    if not config_file:
        raise ValueError(f"no CONFIG.toml given; {USAGE}")
    if values.get("checkpoint") and values.get("hf"):
        raise ValueError(f"give --checkpoint or --hf, not both; {USAGE}")
    if not values.get("nproc", "1").isdigit() or int(values.get("nproc", "1")) < 1:
        raise ValueError(f"--nproc must be a number of ranks >= 1, got {values['nproc']!r}")
    return EvalArgs(config_file, overrides=rest, **values)


def preflight(args: EvalArgs):
    """What the ranks would reject, checked once: the job's config (ValueError on a user error)."""
    from titanrl.components import launch
    from titanrl.config import load_config
    from titanrl.models.tokenizer import build_tokenizer
    from titanrl.rl.evaluation import load_suites, suite_reward

    config = load_config(args.config_args())
    if not config.eval:
        raise ValueError(f"{args.config_file} declares no [[eval]] suites: add one (docs/evaluation.md)")
    path = args.checkpoint.rstrip("/")
    if path and not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"--checkpoint '{path}' is not a complete titanrl step-N checkpoint folder")
    if args.hf and not os.path.isfile(os.path.join(args.hf, "config.json")):
        raise ValueError(f"--hf '{args.hf}' is not a Hugging Face model folder (no config.json)")
    load_suites(config)
    for suite in config.eval:
        suite_reward(suite, config)
    launch.model_args(config, build_tokenizer(config.model.tokenizer).vocab_size)
    return config


def out_path(args: EvalArgs, dump_folder: str) -> str:
    return args.out or os.path.join(dump_folder, "eval.json")


def rank_args(args: EvalArgs, dump_folder: str) -> list[str]:
    """The arguments of `python -m titanrl.evaluate` on each rank."""
    return [f"--out={out_path(args, dump_folder)}", f"--checkpoint={args.checkpoint}", *args.config_args()]


# ---- on each rank ----


def _commit() -> str:
    """The titanrl checkout's commit, if it is a git checkout."""
    try:
        folder = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def summary(config, checkpoint: str, metrics: dict[str, float], world_size: int, commit: str) -> dict:
    """The JSON written by `titanrl eval`: suite -> {metric: value}, and what was evaluated
    (`commit`: the checkout's commit when the evaluation started; a long one may outlive it)."""
    suites: dict[str, dict] = {s.name: {"metrics": {}, "settings": dataclasses.asdict(s)} for s in config.eval}
    for key, value in metrics.items():
        _, name, metric = key.split("/", 2)
        suites[name]["metrics"][metric] = value
    return {
        "config_file": config.job.config_file,
        "checkpoint": checkpoint,
        "hf_checkpoint": config.model.hf_checkpoint,
        "commit": commit,
        "ranks": world_size,
        "suites": suites,
    }


PROGRESS_S = 60.0
"""How often rank 0 prints how many samples have finished."""


def evaluate(config, checkpoint: str) -> tuple[dict[str, float], int, int]:
    """Every suite on the model of `checkpoint` (or the config's model): (metrics, rank, world size)."""
    from titanrl.components import launch
    from titanrl.components.checkpoint import CheckpointManager
    from titanrl.components.model_builder import build_model
    from titanrl.data.encode import PromptEncoder
    from titanrl.models.tokenizer import build_tokenizer
    from titanrl.rl.agent_episodes import build_agent_pool
    from titanrl.rl.builders import build_generator
    from titanrl.rl.evaluation import EvalSuites, load_suites

    suites = load_suites(config)
    rank, dims, device = launch.start(config)
    tokenizer = build_tokenizer(config.model.tokenizer)
    args = launch.model_args(config, tokenizer.vocab_size)
    dp_group = dims.dp_mesh.get_group() if dims.dp_size > 1 else None
    host = EvalHost(config, dims, device, tokenizer, PromptEncoder(tokenizer), dp_group, rank)
    lora = config.lora if config.lora.enable else None
    model = build_model(args, dims, config, device, hf_checkpoint=config.model.hf_checkpoint, lora=lora)
    if checkpoint:
        CheckpointManager(os.path.dirname(checkpoint.rstrip("/")), 0).load(checkpoint, {"model": model}, {})
    tp_mesh = dims.world_mesh["tp"] if dims.tp_enabled else None
    ep_mesh = dims.world_mesh["ep"] if dims.ep_enabled else None
    generator = build_generator(config, args, device, tokenizer, tp_mesh, ep_mesh)
    generator.share_weights(model)
    runner = EvalSuites(host, args.max_seq_len, suites, progress_s=PROGRESS_S)
    agents = None
    try:
        if config.agent.function:  # the suites' samples are episodes of the job's agent
            agents = build_agent_pool(
                config, PromptEncoder.from_config(config.data, config.model.tokenizer, tokenizer).template
            )
        generator.wake()
        generator.load_weights(model)
        metrics, _ = runner.run(generator, agents)
        generator.sleep()
    finally:
        runner.close()
        if agents is not None:
            agents.close()
    return metrics, rank, dims.world_size


@dataclass
class EvalHost:
    """What the suites need of their process (`titanrl.rl.host.RolloutHost`), without a Trainer:
    the job's config, the mesh, the device, the tokenizer, a prompt encoder (each suite builds its
    own from its chat settings), the data-parallel group (None on one rank) and the global rank."""

    config: Any
    dims: Any
    device: Any
    tokenizer: Any
    encode_prompt: Any
    dp_group: Any
    rank: int


def _split_rank_args(argv: list[str]) -> tuple[str, str, list[str]]:
    out = checkpoint = ""
    rest = []
    for arg in argv:
        if arg.startswith("--out="):
            out = arg.partition("=")[2]
        elif arg.startswith("--checkpoint="):
            checkpoint = arg.partition("=")[2]
        else:
            rest.append(arg)
    return out, checkpoint, rest


def rank_main(argv: list[str] | None = None) -> None:
    from titanrl.components import launch
    from titanrl.config import load_config

    out, checkpoint, config_args = _split_rank_args(sys.argv[1:] if argv is None else argv)
    config = load_config(config_args)
    commit = _commit()
    # stdout is the JSON summary alone (`titanrl eval ... | jq`): the ranks' notices go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        metrics, rank, world_size = evaluate(config, checkpoint)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(summary(config, checkpoint, metrics, world_size, commit), f, indent=2)
            f.write("\n")
    launch.shutdown()


if __name__ == "__main__":
    from titanrl.components import launch

    launch.run(rank_main)

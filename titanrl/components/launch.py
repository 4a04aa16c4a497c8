"""What the entry point (`titanrl.train`) and the `Trainer` do around the loop: parse the
config, join the process group, size the model, own the dump folder, stop on preemption signals,
shut down, report user errors."""

import contextlib
import ctypes
import fcntl
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanrl.components.checkpoint import CheckpointManager
from titanrl.components.checkpoint_errors import CheckpointSaveError, free_bytes
from titanrl.components.checkpoint_integrity import CheckpointCorrupt, verify_checkpoint
from titanrl.components.compile_cache import use_compile_cache
from titanrl.components.console import get_logger
from titanrl.config import JobConfig, help_text, load_config, to_toml
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed import ParallelDims, device_type, init_distributed, set_determinism
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.hf import read_hf_config
from titanrl.models.lora import add_lora, is_lora_key
from titanrl.models.model import Transformer

log = get_logger(__name__)


def parse_args(argv: list[str] | None) -> JobConfig | None:
    """The job's config from the command line; None after printing --help."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return None
    return load_config(argv)


def die_with_launcher() -> None:
    """Under torchrun, SIGKILL this rank when the launcher dies. torchrun starts each rank in its
    own session, so killing the launcher's process group does not reach the ranks: they trained
    on as orphans and raced the next run for the dump folder. Not set without torchrun, where the
    parent is a shell (a `nohup` run must outlive it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if parent == 1:  # the launcher died before this rank got here: nobody is left to follow
        os._exit(1)
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the line above took effect
        os._exit(1)


LOCK_FILE = ".titanrl.lock"
STOPPED_FILE = "stopped.json"


def lock_dump_folder(folder: str) -> IO:
    """Hold an exclusive lock on `folder` for this process's life (the OS drops it when the
    process dies, however it dies): two runs writing one folder tear each other's metrics and
    checkpoints. The returned file must stay open."""
    os.makedirs(folder, exist_ok=True)
    f = open(os.path.join(folder, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(
            f"job.dump_folder '{folder}' is in use by {holder}: another titanrl run is writing there; "
            "wait for it to finish or stop it, or give this run another --job.dump_folder"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    f.flush()
    return f


def check_dump_folder_free(folder: str) -> None:
    """Raise ValueError naming the holder if a running job holds `folder`'s lock."""
    if os.path.exists(os.path.join(folder, LOCK_FILE)):
        lock_dump_folder(folder).close()


class StopSignals:
    """SIGTERM and SIGUSR1 (preemption: Slurm `--signal`, Kubernetes, torchrun forwarding its own
    SIGTERM) ask the run to stop at the next step boundary: the Trainer saves a checkpoint there
    and exits 0, so a requeued job resumes. The handler only records the signal: collectives and
    reward workers in flight finish normally. Ctrl-C (SIGINT) still stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def restore(self) -> None:
        """Put back the handlers found at start (a Trainer built inside another program, e.g. tests)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: object) -> None:
        del frame
        if not self.received:
            log.warning(f"titanrl: {signal.Signals(signum).name} received; stopping after this step with a checkpoint")
        self.received = self.received or signum

    def agreed(self) -> int:
        """The signal any rank received (0: none), the same on every rank: all must stop together."""
        if not dist.is_initialized():
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def write_stopped(folder: str, signum: int, step: int, checkpoint: str) -> None:
    """Rank 0's record that the run stopped on a signal with a checkpoint (`titanrl run` reads it
    to exit 0 instead of torchrun's signal error)."""
    record = {"signal": signal.Signals(signum).name, "step": step, "checkpoint": checkpoint, "time": time.time()}
    with open(os.path.join(folder, STOPPED_FILE), "w") as f:
        json.dump(record, f)


def start(config: JobConfig) -> tuple[int, ParallelDims, torch.device]:
    """Join torchrun's process group, seed every RNG, build the device mesh: (rank, dims, device).
    Compiled code is cached under the dump folder (`compile_cache.py`)."""
    die_with_launcher()
    use_compile_cache(config.job.dump_folder)
    rank, world_size = init_distributed(single_process_group=config.training.mixed_precision_param != "float32")
    set_determinism(config.job.seed, config.job.deterministic)
    if rank == 0 and config.job.print_config:
        log.info(to_toml(config))
    p = config.parallelism
    ft = config.fault_tolerance
    replica, replicas = (ft.replica_id, ft.group_size) if ft.enable else (0, 1)
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world_size, p.ep, p.cp, replica, replicas)
    return rank, dims, local_device()


def local_device() -> torch.device:
    """This process's device: its torchrun LOCAL_RANK's GPU, else the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(device_type())


def model_args(config: JobConfig, vocab_size: int) -> TransformerModelArgs:
    """The model's shape: from model.hf_checkpoint's config.json, else model.flavor."""
    hf = config.model.hf_checkpoint
    args = read_hf_config(hf) if hf else get_model_args(config.model.flavor)
    if config.model.max_seq_len:
        args.max_seq_len = config.model.max_seq_len
    if vocab_size > args.vocab_size:
        raise ValueError(
            f"tokenizer has {vocab_size} tokens but model vocab_size is {args.vocab_size}; "
            "pick a matching model.flavor / model.tokenizer"
        )
    return args


def shutdown() -> None:
    """Leave the process group together (no rank exits while another still reduces)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


USER_ERRORS = (ValueError, CheckpointSaveError, FloatingPointError)
"""What a user acts on, with a message naming the cause and the fix: bad config, data, paths or
degrees (ValueError, `CheckpointCorrupt` among them), a checkpoint that cannot be written (disk
full, no permission), a non-finite update under training.on_nonfinite = 'stop'."""

ERROR_LOG = "errors.log"
"""The file under job.dump_folder where a run's user error leaves its traceback."""


def run(main: Callable[[], object]) -> None:
    """Run an entry point; a user error (`USER_ERRORS`: config, data, degrees, a checkpoint that
    cannot be saved ...) exits with code 2 and its message, which names the cause and the fix,
    instead of a traceback. Then free what the run left in
    reference cycles: its model (FSDP state holding process groups) stays alive after `main`
    returns until a garbage collection (62 modules on the 2-rank SFT job) - else the
    interpreter's unordered teardown at exit destroys the groups, and a rank of a finished run
    was seen to abort there ("terminate called without an active exception", gloo, rare)."""
    try:
        main()
    except USER_ERRORS as e:
        report_user_error(e)
        sys.exit(2)
    gc.collect()


@contextlib.contextmanager
def errors_logged(folder: str) -> Iterator[None]:
    """Around a run's steps: a user error raised inside leaves its traceback in
    `<folder>/errors.log` (appended, headed by the rank and time), and its one-line report
    (`report_user_error`) names that file."""
    try:
        yield
    except USER_ERRORS as e:
        path = os.path.join(folder, ERROR_LOG)
        header = f"rank {os.environ.get('RANK', '0')}, {time.strftime('%Y-%m-%d %H:%M:%S')}:\n"
        try:
            with open(path, "a") as f:
                f.write(header + "".join(traceback.format_exception(e)) + "\n")
            setattr(e, "titanrl_log", path)  # noqa: B010  # read by report_user_error
        except OSError:
            pass  # the folder cannot take it (the disk that is full): the line alone names the cause
        raise


ERROR_DIR_ENV = "TITANRL_ERROR_DIR"
"""Set by `titanrl run`: the folder where a rank leaves its user error for the launcher to print."""


def report_user_error(error: BaseException) -> None:
    """The one line `titanrl: error: <message>` on stderr (with the traceback's file when
    `errors_logged` wrote one). Under `titanrl run` the rank writes it
    to `$TITANRL_ERROR_DIR/rank<N>.txt` instead and the launcher prints the failed rank's line
    once: every rank of a job usually fails the same way, and N ranks printed N copies."""
    line = "titanrl: error: " + " ".join(str(error).splitlines())
    if getattr(error, "titanrl_log", None):
        line += f" (traceback in {error.titanrl_log})"  # type: ignore[attr-defined]
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(line + "\n")
        return
    log.error(line)


# ---- pre-flight of the checkpoint a run resumes from (`titanrl run`, before any rank starts) ----


def checkpoint_to_load(config: JobConfig) -> str | None:
    """The step-N folder the ranks will resume from, its files checked against its checksum
    manifest: checkpoint.load_path (`CheckpointCorrupt`, a ValueError, when it fails the check),
    else the latest complete checkpoint under the dump folder that passes (the ranks skip a
    failing one too, and say so in one line; `CheckpointCorrupt` when none passes); None for a
    fresh run."""
    ckpt = config.checkpoint
    if not ckpt.enable:
        return None
    if ckpt.load_path:
        path = ckpt.load_path.rstrip("/")
        if os.path.isdir(path):
            verify_checkpoint(path)
        return path
    manager = CheckpointManager(os.path.join(config.job.dump_folder, ckpt.folder), ckpt.keep_latest_k)
    reasons = []
    for step in reversed(manager.complete_steps()):
        try:
            verify_checkpoint(manager.step_dir(step))
            return manager.step_dir(step)
        except CheckpointCorrupt as e:
            reasons.append(str(e))
    if reasons:
        raise CheckpointCorrupt(
            f"no checkpoint in {manager.folder} passes its checksums ({'; '.join(reasons)}); set "
            f"checkpoint.load_path to an intact step-N folder, or move {manager.folder} away to start a fresh run"
        )
    return None


def check_checkpoint_shapes(path: str, args: TransformerModelArgs, lora: LoRAConfig | None) -> None:
    """Compare the shape and dtype of every model parameter in the checkpoint's DCP metadata with
    the model the config builds (on the meta device: no memory, no rank); ValueError naming the
    first parameter that differs. A LoRA run saves and loads its adapters only, so only those
    must be there. Unreadable metadata is left to the ranks, which fall back to an older one."""
    try:
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:
        return
    with torch.device("meta"):
        model = Transformer(args)
        if lora is not None:
            add_lora(model, lora)
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    saved = {k: v for k, v in saved.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    fix = (
        "point checkpoint.load_path at a checkpoint of this model, set model.flavor / model.hf_checkpoint "
        "to the checkpoint's model, or start a fresh run in another --job.dump_folder"
    )
    for key, tensor in expected.items():
        meta = saved.get(key)
        was = _shape(meta.size, meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        now = _shape(tensor.shape, tensor.dtype)
        if was is not None and was != now:
            raise ValueError(
                f"checkpoint '{path}' does not fit the model: '{key}' is {was} in the checkpoint but {now} "
                f"in the model ({describe_model(args)}); {fix}"
            )
    heads = {"model.output.weight", "model.score.weight"}  # a reward model's head replaces the LM head
    loaded = [k for k in expected if k not in heads and (lora is None or is_lora_key(k))]
    odd = [f"'{k}' is not in the checkpoint" for k in loaded if k not in saved]
    odd += [f"the checkpoint's '{k}' is not in the model" for k in saved if k not in expected and k not in heads]
    if odd:
        more = f" ({len(odd) - 1} more)" if len(odd) > 1 else ""
        raise ValueError(f"checkpoint '{path}' does not fit the model ({describe_model(args)}): {odd[0]}{more}; {fix}")


def _shape(size, dtype: torch.dtype) -> str:
    return f"{list(size)} {str(dtype).removeprefix('torch.')}"


def describe_model(args: TransformerModelArgs) -> str:
    return f"dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}"


def check_free_space(config: JobConfig, path: str) -> None:
    """ValueError when the dump folder's file system has less free space than the checkpoint the
    run resumes from takes: the next save (written whole before an older one is removed) could
    not fit, and the run would fail there after training that long."""
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    free = free_bytes(config.job.dump_folder)
    if free is not None and free < size:
        raise ValueError(
            f"no space left on device for the next checkpoint: the file system of job.dump_folder "
            f"'{config.job.dump_folder}' has {_mib(free)} free, less than the {_mib(size)} of the checkpoint "
            f"'{path}' this run resumes from; free disk space, lower checkpoint.keep_latest_k, or point "
            "job.dump_folder at a larger disk"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

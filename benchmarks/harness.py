"""The benchmarks' shared harness: an environment record, timing, a process's peak memory, one JSON shape.

Every benchmark runs from the repository root as a module, so that `titanrl` and `benchmarks`
import without any sys.path edit:

    python -m benchmarks.bench_generate --out benchmarks/bench_generate.json

and writes {"commit", "device", "command", "environment", "results"} through `write_json`;
`python scripts/gen_benchmark_docs.py` then renders every benchmarks/*.json into
docs/benchmarks.md. Peers (titanrl against HF, TRL, vLLM, or one mode against another) are
timed in the same run, interleaved (`timeit_each`), so that a slow spell of a shared machine
hits all of them alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, TypeVar

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Top-level keys of a benchmark JSON that describe the run, not its results (files written before
# this harness kept "date" / "machine" beside their results).
METADATA_KEYS = frozenset("commit device command environment metadata_backfilled metadata_note date machine".split())
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of repeated calls: their median, their minimum and all of them in call order."""

    median: float
    min: float
    times: list[float]

    @classmethod
    def of(cls, times: Sequence[float]) -> Timing:
        return cls(statistics.median(times), min(times), list(times))


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def _device(device: torch.device | str | None) -> torch.device:
    """`device`, or by default CUDA once this process has initialised it, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_initialized() else "cpu")


def device_name(device: torch.device | str | None = None) -> str:
    """'cuda: NVIDIA H200' or 'cpu: x86_64 AMD EPYC 7B13, 2 cores'."""
    device = _device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.machine()} {cpu_name()}, {os.cpu_count()} cores"


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a result depends on besides its code: commit (`dirty`: tracked files differ from it,
    benchmark JSONs and Markdown aside), device, versions and thread count. No host name."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/*.json", ":!*.md")
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown",
        "dirty": None if status is None else bool(status),
        "device": device_name(device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[float, T]:
    """Seconds of one call of `fn` and what it returned. On a GPU the device is synchronised
    before the clock starts and before it stops, so the kernels the call queued are counted."""
    device = _device(device)
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def timeit_each(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 1,
    repeat: int = 5,
    device: torch.device | str | None = None,
) -> dict[str, Timing]:
    """`warmup` untimed calls of each function, then `repeat` timed ones, interleaved (a, b, c,
    a, b, c, ...): peers measured side by side share the machine's slow spells."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(timed_call(fn, device)[0])
    return {name: Timing.of(t) for name, t in times.items()}


def timeit(
    fn: Callable[[], object], *, warmup: int = 1, repeat: int = 5, device: torch.device | str | None = None
) -> Timing:
    """Median, minimum and all seconds of `repeat` calls of `fn` after `warmup` untimed ones."""
    return timeit_each({"fn": fn}, warmup=warmup, repeat=repeat, device=device)["fn"]


def decode_seconds(run: Callable[[int], object], new_tokens: int, device: torch.device | str | None = None) -> float:
    """Seconds of the `new_tokens - 1` decode steps of a generation: the time of `run(new_tokens)`
    less that of `run(1)` (prefill and first token). Decode tokens/s = batch * (new_tokens - 1) / it."""
    total, _ = timed_call(lambda: run(new_tokens), device)
    prefill, _ = timed_call(lambda: run(1), device)
    return total - prefill


def command_line(argv: Sequence[str] | None = None) -> str:
    """`argv` (default `sys.argv`) as typed at the repository root: a benchmark module as
    `python -m benchmarks.<name>`."""
    argv = list(sys.argv if argv is None else argv)
    path = os.path.abspath(argv[0]) if argv else ""
    if os.path.dirname(path) == os.path.join(REPO_ROOT, "benchmarks") and path.endswith(".py"):
        head = f"python -m benchmarks.{os.path.basename(path)[:-3]}"
    else:
        head = shlex.quote(argv[0]) if argv else "python"
    return " ".join([head, *(shlex.quote(arg) for arg in argv[1:])])


def _jsonable(obj: object) -> object:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_json(
    path: str,
    results: dict[str, Any],
    command: str | Sequence[str] | None = None,
    *,
    device: torch.device | str | None = None,
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write {"commit", "device", "command", "environment", "results"} to `path`, atomically (a
    run cut short never leaves half a file), and return it. `command`: a string, or an argv
    (default `sys.argv`); `env`: an `environment()` taken earlier (say at the start of a long
    run, the code its subprocesses import), else one taken now for `device`."""
    env = env if env is not None else environment(device)
    report = {
        "commit": env["commit"],
        "device": env["device"],
        "command": command if isinstance(command, str) else command_line(command),
        "environment": env,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=2, default=_jsonable)
        f.write("\n")
    os.replace(f"{path}.tmp", path)
    return report


def read_results(path: str) -> tuple[dict[str, Any], str]:
    """The results in an earlier JSON at `path` and the commit that made them ({} and "" when
    there is no file). Files written before this harness hold their results at the top level."""
    if not os.path.exists(path):
        return {}, ""
    with open(path) as f:
        report = json.load(f)
    if "environment" in report:
        return report["results"], report["commit"]
    return {k: v for k, v in report.items() if k not in METADATA_KEYS}, report.get("commit", "unknown")


def keep_earlier_sections(path: str, rerun: Sequence[str], sections: Sequence[str]) -> dict[str, Any]:
    """For a benchmark run section by section: the `sections` of the results at `path` that this
    run does not redo, and under "earlier_sections" the commit that measured each of them."""
    earlier, commit = read_results(path)
    kept = {k: earlier[k] for k in sections if k in earlier and k not in rerun}
    if not kept:
        return {}
    measured_at = earlier.get("earlier_sections", {})
    return {**kept, "earlier_sections": {k: measured_at.get(k, commit) for k in kept}}


# ---- a process's peak memory ----


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _descendants(pid: int) -> list[int]:
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parent_of.items() if pp in frontier]
        found += children
        frontier = children
    return found


class RssSampler(threading.Thread):
    """Samples the RSS of a process and of its whole tree every `interval_s` until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_main_kib = self.peak_tree_kib = self.peak_other_kib = 0
        self.max_processes = 1
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            main = _rss_kib(self.pid)
            others = [_rss_kib(p) for p in _descendants(self.pid)]
            self.peak_main_kib = max(self.peak_main_kib, main)
            self.peak_tree_kib = max(self.peak_tree_kib, main + sum(others))
            self.peak_other_kib = max([self.peak_other_kib, *others])
            self.max_processes = max(self.max_processes, 1 + len(others))
            self.stopped.wait(self.interval_s)


def run_measured(cmd: list[str], env: dict, log_path: str) -> dict:
    """Run `cmd` to completion; its max RSS (os.wait4) and sampled RSS peaks, in GiB."""
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        sampler = RssSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stopped.set()
        sampler.join()
    if proc.returncode:
        with open(log_path) as f:
            raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}), log {log_path}:\n{f.read()[-3000:]}")
    return {
        "max_rss_gb": usage.ru_maxrss / 2**20,
        "sampled_peak_rss_gb": sampler.peak_main_kib / 2**20,
        "sampled_peak_tree_rss_gb": sampler.peak_tree_kib / 2**20,
        "sampled_peak_child_rss_gb": sampler.peak_other_kib / 2**20,
        "processes": sampler.max_processes,
        "wall_s": time.perf_counter() - began,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }


def episode_report(out: str, benchmark: str, config: dict, summary: dict, ratios: dict, runs: list) -> dict:
    """The episodes benchmarks' report (servers / endpoint vs in-process): printed (summary and
    ratios) and, given `out`, written with `write_json`."""
    report = {"benchmark": benchmark, "config": config, "summary": summary, "ratios": ratios, "runs": runs}
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    if out:
        write_json(out, report)
    return report

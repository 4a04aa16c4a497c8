"""The reward worker: its main loop and the trainer's handle on it (`RewardWorker`); the set-up
it shares with environment workers is `titanrl/components/worker_setup.py: init_worker`.

A reward worker is a plain interpreter running `reward_worker_main`: this module imports nothing
heavy (no torch, no titanrl module that imports it), so a worker starts in the time the
interpreter and the reward function's module take to import, never in the trainer's. One
length-prefixed pickle frame each way per sample:
  trainer -> worker: the init dict once, then (sample index, mode, args) per call;
  worker -> trainer: ("ready",) once, then (sample index, kind, reward, correct, detail) per call,
  kind 'ok', 'error', 'memory' or 'invalid'.
Its stdout and stderr (file descriptors 1 and 2, so C code and subprocesses too) are one pipe
that the trainer drains. Each worker is contained (`titanrl/components/containment.py`): the
child of a keeper that kills everything the worker started, `setsid` children and daemons
included, when the worker ends, is killed, or the trainer dies.
"""

import ctypes
import math
import os
import pickle
import selectors
import signal
import struct
import sys
from typing import Any

from titanrl.components.containment import OOM_EXIT_CODE, spawn_contained, stop_contained
from titanrl.components.worker_setup import init_worker

_HEADER = struct.Struct("<Q")
DETAIL_CHARS = 2000
"""The longest failure detail (exception and traceback tail) a worker sends back."""
OUTPUT_KEEP_BYTES = 4096
"""Bytes of a sample's output (stdout and stderr) kept; the rest is only counted."""
_READ_CHUNK = 1 << 16
_MAX_READS = 16  # per wake-up: a pipe's worth (64 KiB) is one read; a flood cannot starve the loop
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_frame(fd: int, obj: object) -> None:
    """Write `obj` pickled, length-prefixed, to a blocking `fd`."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def frame(obj: object) -> bytes:
    """`obj` as one length-prefixed frame (for the trainer's non-blocking writes)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def split_frames(buffer: bytearray) -> list[Any]:
    """Remove every complete frame from the front of `buffer`; return them unpickled."""
    out: list[Any] = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + size:
            break
        out.append(pickle.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return out


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    """The next frame from a blocking `fd`; EOFError when the writer closed it."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, size))


def _score(fn: Any, mode: str, args: tuple) -> tuple[str, float, bool, str]:
    """Call the user's function on one sample: (kind, reward, correct, detail)."""
    if mode == "task":  # a titanrl Task's verifier: args = (completion, answer, metadata)
        score = fn.score(*args)
        reward, correct = score.reward, score.correct
    else:  # args = (prompt, completion, metadata)
        out = fn(*args)
        reward, correct = (out["reward"], bool(out.get("correct", False))) if isinstance(out, dict) else (out, False)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return "invalid", 0.0, False, f"reward is a {type(reward).__name__}, not a number"
    try:
        value = float(reward)
    except OverflowError:
        return "invalid", 0.0, False, "reward is an int too large for a float"
    if not math.isfinite(value):
        return "invalid", 0.0, False, f"reward is {value}"
    return "ok", value, bool(correct), ""


def _describe(e: BaseException) -> str:
    """The exception and the last frames of its traceback, this module's frames left out."""
    try:
        import traceback

        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        text = "".join(traceback.format_exception(type(e), e, tb, limit=-4))
    except BaseException:  # noqa: BLE001 - e.g. MemoryError again, or a __str__ that raises
        text = type(e).__name__
    return text[-DETAIL_CHARS:]


def _flush_output(libc: ctypes.CDLL | None) -> None:
    # Everything the call printed must be in the pipe before its result is sent: the trainer
    # attributes what it drained then to this sample. libc's buffer holds printf from C code.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the user may have closed or replaced the stream
            pass
    if libc is not None:
        libc.fflush(None)


def reward_worker_main(request_fd: int, result_fd: int) -> None:
    """The reward worker: load the function, then score samples until the trainer closes the pipe."""
    init = read_frame(request_fd)
    if init["main"]:  # the function lives in the trainer's __main__: import it as multiprocessing does
        from multiprocessing import spawn

        spawn.prepare({"sys_path": init["sys_path"], **init["main"]})
    else:
        sys.path[:] = init["sys_path"]
    fn = pickle.loads(init["fn"])  # imports the user's module before the memory limit is measured
    init_worker(init["memory_limit_mb"])  # its keeper checked that the trainer lives
    import faulthandler

    faulthandler.enable()  # a segfault's traceback goes to stderr, which the trainer captures
    libc: ctypes.CDLL | None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        libc = None
    me = os.getpid()
    write_frame(result_fd, ("ready",))
    while True:
        try:
            index, mode, args = read_frame(request_fd)
        except EOFError:
            return
        try:
            kind, reward, correct, detail = _score(fn, mode, args)
        except MemoryError as e:
            kind, reward, correct, detail = "memory", 0.0, False, _describe(e)
        # BaseException: SystemExit, KeyboardInterrupt or GeneratorExit raised by user code fail
        # this sample only; the worker lives on.
        except BaseException as e:  # noqa: BLE001
            kind, reward, correct, detail = "error", 0.0, False, _describe(e)
        if os.getpid() != me:  # a process the user's code forked came back here: it must not answer
            os._exit(0)
        _flush_output(libc)
        write_frame(result_fd, (index, kind, reward, correct, detail))


class RewardWorker:
    """The trainer's handle on one reward worker process: its pipes (non-blocking, registered in
    `sel` with data (worker, 'results' | 'output' | 'exit' | 'requests')), the sample it runs and
    that sample's output so far."""

    def __init__(self, sel: selectors.BaseSelector, init: dict) -> None:
        self.sel = sel
        self.ready = self.dead = self.results_closed = self.over_memory = False
        self.death = ""
        self.sample: int | None = None
        self.outbox = memoryview(b"")  # request bytes the pipe has not taken yet
        self.inbox = bytearray()  # result bytes not yet a whole frame
        self.kept, self.dropped = bytearray(), 0
        req_r, self.requests = os.pipe()
        self.results, res_w = os.pipe()
        self.output, out_w = os.pipe()
        try:
            # `proc` is the worker's keeper; it exits as the worker did, once nothing of it is left.
            self.proc = spawn_contained("titanrl.rewards.worker:reward_worker_main", (req_r, res_w), out_w, _ROOT)
        except BaseException:
            for fd in (self.requests, self.results, self.output):
                os.close(fd)
            raise
        finally:
            for fd in (req_r, res_w, out_w):
                os.close(fd)
        for fd in (self.requests, self.results, self.output):
            os.set_blocking(fd, False)
        try:
            self.pidfd: int | None = os.pidfd_open(self.proc.pid)
            sel.register(self.pidfd, selectors.EVENT_READ, (self, "exit"))
        except (AttributeError, OSError):  # not Linux >= 5.3: the runner polls `exited`
            self.pidfd = None
        sel.register(self.results, selectors.EVENT_READ, (self, "results"))
        sel.register(self.output, selectors.EVENT_READ, (self, "output"))
        self.send(init)

    def send(self, obj: object) -> None:
        self.outbox = memoryview(frame(obj))
        self.write()

    def write(self) -> None:
        """Write what the pipe takes of the outbox; wait (selector) to write the rest."""
        try:
            while self.outbox:
                self.outbox = self.outbox[os.write(self.requests, self.outbox) :]
        except BlockingIOError:
            pass
        except BrokenPipeError:  # it died: its exit is reported separately
            self.outbox = memoryview(b"")
        registered = self.requests in self.sel.get_map()
        if self.outbox and not registered:
            self.sel.register(self.requests, selectors.EVENT_WRITE, (self, "requests"))
        elif not self.outbox and registered:
            self.sel.unregister(self.requests)

    def read_results(self) -> list[tuple]:
        """The whole messages received; ValueError if what came is not frames of a worker."""
        while True:
            try:
                chunk = os.read(self.results, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self.results_closed = True
                break
            self.inbox += chunk
        try:
            messages = split_frames(self.inbox)
        except Exception as e:  # noqa: BLE001 - the user's code wrote on the pipe
            raise ValueError("garbage on its result pipe") from e
        if not all(isinstance(m, tuple) and (m == ("ready",) or len(m) == 5) for m in messages):
            raise ValueError("garbage on its result pipe")
        return messages

    def read_output(self, reads: int = _MAX_READS) -> None:
        """Keep the first OUTPUT_KEEP_BYTES of the current sample's output, count the rest."""
        for _ in range(reads):
            try:
                chunk = os.read(self.output, _READ_CHUNK)
            except OSError:  # BlockingIOError: nothing more now; EBADF: closed at its end
                return
            if not chunk:  # every writer is gone
                self.sel.unregister(self.output)
                os.close(self.output)
                self.output = -1
                return
            room = max(OUTPUT_KEEP_BYTES - len(self.kept), 0)
            self.kept += chunk[:room]
            self.dropped += max(len(chunk) - room, 0)

    def take_output(self) -> tuple[str, int]:
        """(kept output, bytes dropped) of the current sample; the next one starts afresh."""
        out = self.kept.decode("utf-8", "replace"), self.dropped
        self.kept, self.dropped = bytearray(), 0
        return out

    def exited(self) -> bool:
        """Has it exited? Without reaping it, so that its process group id stays ours."""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill(self) -> str:
        """Kill it and everything it started (its keeper does), reap its keeper, close its pipes;
        how it died. Idempotent: closing its pipes twice could close descriptors reused since."""
        if self.dead:
            return self.death
        self.read_output()  # e.g. the traceback faulthandler printed as it died
        code = stop_contained(self.proc)
        for fd in (self.requests, self.results, self.output, self.pidfd):
            if fd is not None and fd >= 0:
                if fd in self.sel.get_map():
                    self.sel.unregister(fd)
                os.close(fd)
        self.dead = True
        self.over_memory = code == OOM_EXIT_CODE
        if self.over_memory:
            self.death = "the worker crossed its memory limit (reward.memory_limit_mb) and was killed"
        elif code >= 0:
            self.death = f"the worker exited with code {code}"
        else:
            try:
                self.death = f"the worker was killed by {signal.Signals(-code).name}"
            except ValueError:  # a real-time signal has no name
                self.death = f"the worker was killed by signal {-code}"
        return self.death

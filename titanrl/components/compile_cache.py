"""Compiled code that outlives the process, and the seconds spent compiling.

`torch.compile`'s inductor caches what it builds (FX graphs, AOTAutograd graphs, Triton kernels,
autotuning results) in one folder. `use_compile_cache` points it at `<dump_folder>/compile_cache`,
so a restarted or resumed job, on any node that sees the dump folder, loads its compiled code
instead of building it again (dynamo still traces: seconds, not minutes). A folder set with
`TORCHINDUCTOR_CACHE_DIR` before titanrl was imported is kept.
"""

import os

COMPILE_CACHE = "compile_cache"
_USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def use_compile_cache(dump_folder: str) -> str:
    """Cache compiled code under `dump_folder` (unless the user chose a folder); returns the folder.
    Inductor reads the variable whenever it opens its cache, so this holds from the next compile."""
    if _USER_CACHE_DIR is not None:
        return _USER_CACHE_DIR
    folder = os.path.join(os.path.abspath(dump_folder), COMPILE_CACHE)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def compile_seconds() -> float:
    """Seconds this process has spent in `torch.compile` so far (tracing and inductor; cache hits
    cost the tracing only)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("entire_frame_compile", 0.0)

"""A hand-written CPU kernel for the decode step's paged attention (AVX-512, float32 or bfloat16).

The compiled pure-PyTorch form (`DecodeAttention._attend_in_place`) reads the pages in place
but pays index arithmetic per position; `csrc/paged_decode_attention.c` walks each row's pages
with whole-register loads (a page's keys per feature, a value row; rows and KV heads in
parallel; pages prefetched ahead of use); bench_decode_attention and bench_generate in
docs/benchmarks.md measure it. Eager decode steps gain the most: they otherwise gather the
pages and run SDPA on the copy.

It is built on first use with the system C compiler (`$CC`, else `cc`; torch.compile needs one
on CPU too) and glibc's vector math library, once per block size, head dim and dtype, into
`$TITANRL_CACHE` (default ~/.cache/titanrl), and registered as the op
`titanrl::paged_decode_attention`, so a compiled decode step calls it like an aten op. Where it
cannot run (no AVX-512, float16, no compiler), `attention_impl = "auto"` uses the PyTorch forms.
A bfloat16 pool and query are widened to float32 as they are read; scores, softmax and the
weighted sum are float32, and the output is rounded to bfloat16 once (the compiled PyTorch form
holds scores and probabilities in bfloat16).
"""

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile

import torch

from titanrl.config.rl_sections import Generator as GeneratorConfig

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode_attention.c")
_FLAGS = ["-O3", "-mavx512f", "-mavx512dq", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_LIBS = ["-lmvec", "-lm"]
MIN_COMPILED_BUCKET = 128
"""A compiled decode step calls the kernel from batch buckets of this many rows (smaller ones run
the compiled in-place attention): the call (dispatch to Python, the compiled graph split around
it) costs more than the kernel saves at small batches. Eager steps always call it."""


def unusable_reason(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why the kernel cannot run this generator's decode attention, or None when it can."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "it runs float32 or bfloat16 on CPU"
    if block_size % 16 or head_dim % 16:
        return f"block_size ({block_size}) and head_dim ({head_dim}) must be multiples of 16"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"this CPU's vector ISA is {torch.backends.cpu.get_cpu_capability()}, not AVX512"
    return _build_error(block_size, head_dim, dtype == torch.bfloat16)


def use_for_decode(config: GeneratorConfig, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the generator's decode steps run this kernel: `[generator] attention_impl`
    'cpu_kernel' (an error if it cannot run here) or 'auto' where it can; never in
    batch-invariant mode (its exact attention keeps the trainer's reduction order). In bfloat16
    'auto' uses it under `compile` only: eager decoding otherwise runs the trainer's own SDPA on
    the gathered pages, whose logprobs are the bfloat16 trainer's to ~1e-4, where the kernel's
    (float32 inside) and the compiled PyTorch forms' are to ~1e-2 (tests/test_cpu_kernel.py)."""
    if config.attention_impl not in ("auto", "cpu_kernel") or config.batch_invariant:
        return False
    if config.attention_impl == "auto" and dtype == torch.bfloat16 and not config.compile:
        return False
    reason = unusable_reason(device, dtype, config.block_size, head_dim)
    if reason is not None and config.attention_impl == "cpu_kernel":
        raise ValueError(
            f"[generator] attention_impl = 'cpu_kernel' cannot run here: {reason}; use 'auto' or 'inplace'"
        )
    return reason is None


def _cache_dir() -> str:
    return os.environ.get("TITANRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "titanrl"))


@functools.cache
def _build_error(block_size: int, head_dim: int, bf16: bool) -> str | None:
    """Why `_library` fails for this shape, or None (a failed build is tried once per process)."""
    try:
        _library(block_size, head_dim, bf16)
    except RuntimeError as e:
        return str(e)
    return None


@functools.cache
def _library(block_size: int, head_dim: int, bf16: bool) -> ctypes.CDLL:
    cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]  # $CC may carry arguments ("ccache gcc")
    compiler = shutil.which(cc[0])
    if compiler is None:
        raise RuntimeError("no C compiler ($CC or cc) to build it")
    command = [compiler, *cc[1:], *_FLAGS, f"-DBLOCK={block_size}", f"-DHEAD_DIM={head_dim}", f"-DBF16={int(bf16)}"]
    with open(_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(command).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), "kernels", f"paged_decode_attention_{key}.so")
    try:
        if not os.path.exists(path):
            _build(command, path)
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(
            f"it could not be built or loaded at {path} ({e}); $TITANRL_CACHE names a writable folder for it"
        ) from e
    fn = lib.titanrl_paged_decode_attention
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]
    return lib


def _build(command: list[str], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Ranks of one job build at once: each into its own file, renamed into place (atomic).
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        proc = subprocess.run([*command, _SOURCE, "-o", tmp, *_LIBS], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{command[0]} failed to build it: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def paged_decode_attention(
    q_NGRD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table_NM: torch.Tensor, pos_N: torch.Tensor
) -> torch.Tensor:
    """Row n's query heads attend to its positions 0..pos_N[n] through block table row n.
    `q_NGRD` [N, G, R, D] (G KV heads, R query heads each), `k_pages` [pages, G, D, block] (keys
    transposed), `v_pages` [pages, block, G, D], `table_NM` and `pos_N` int64. Returns [N, G, R, D]."""
    return torch.ops.titanrl.paged_decode_attention.default(q_NGRD, k_pages, v_pages, table_NM, pos_N)


def decode_attention(
    q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table_NM: torch.Tensor, pos_N: torch.Tensor
) -> torch.Tensor:
    """`paged_decode_attention` for a decode step's queries [N, H, D] (the query heads of a KV
    head adjacent, as in the model); returns [N, H, D]."""
    N, H, D = q_NHD.shape
    q_NGRD = q_NHD.view(N, v_pages.shape[2], H // v_pages.shape[2], D)
    return paged_decode_attention(q_NGRD, k_pages, v_pages, table_NM, pos_N).view(N, H, D)


def _paged_decode_attention_cpu(q_NGRD, k_pages, v_pages, table_NM, pos_N):
    N, G, R, D = q_NGRD.shape
    B = v_pages.shape[1]
    # Invariants of the generator's pool and decode step (a mismatch would read out of bounds).
    assert k_pages.shape[1:] == (G, D, B) and v_pages.shape[1:] == (B, G, D), (q_NGRD.shape, k_pages.shape)
    assert k_pages.is_contiguous() and v_pages.is_contiguous()
    assert q_NGRD.dtype == k_pages.dtype == v_pages.dtype in (torch.float32, torch.bfloat16)
    assert q_NGRD.device.type == "cpu"
    assert table_NM.dtype == pos_N.dtype == torch.int64 and table_NM.shape[0] == pos_N.shape[0] == N
    q_NGRD, table_NM, pos_N = q_NGRD.contiguous(), table_NM.contiguous(), pos_N.contiguous()
    out_NGRD = torch.empty_like(q_NGRD)
    fn = _library(B, D, q_NGRD.dtype == torch.bfloat16).titanrl_paged_decode_attention
    fn(
        q_NGRD.data_ptr(),
        k_pages.data_ptr(),
        v_pages.data_ptr(),
        table_NM.data_ptr(),
        pos_N.data_ptr(),
        out_NGRD.data_ptr(),
        N,
        G,
        R,
        table_NM.shape[1],
        D**-0.5,
        torch.get_num_threads(),
    )
    return out_NGRD


def _paged_decode_attention_fake(q_NGRD, k_pages, v_pages, table_NM, pos_N):
    return torch.empty_like(q_NGRD, memory_format=torch.contiguous_format)


def _register_op() -> None:
    """A plain `torch.library` op (not `custom_op`, whose Python wrapper costs a noticeable share
    of a small decode step). The registrations live in
    torch.library (not in this module), so a re-import finds the op defined and keeps it."""
    if hasattr(torch.ops.titanrl, "paged_decode_attention"):
        return
    qualname = "titanrl::paged_decode_attention"
    torch.library.define(
        qualname, "(Tensor q_NGRD, Tensor k_pages, Tensor v_pages, Tensor table_NM, Tensor pos_N) -> Tensor"
    )
    torch.library.impl(qualname, "cpu", _paged_decode_attention_cpu)
    torch.library.register_fake(qualname, _paged_decode_attention_fake)


_register_op()

"""Decode attention alone: the hand-written CPU kernel vs the compiled pure-PyTorch in-place form.

One decode step's attention over a paged pool (keys transposed, pages in random order, rows at
random positions in [ctx / 2, ctx)), for several shapes: `cpu_kernel.paged_decode_attention`
against `DecodeAttention._attend_in_place` under `torch.compile` (what `attention_impl =
"inplace"` runs). Best of 10 timings of 30 calls each, the two alternating, so the pool is warm
in cache: this isolates the kernels (in a decode step the pool is read cold more often and the
gain is smaller; `benchmarks/bench_generate.py` measures whole steps). Also the largest difference
of each from a float64 reference. `--dtype bfloat16`: pool and queries in bfloat16 (the kernel
widens them to float32 as it reads; the compiled form computes as PyTorch does in bfloat16).

    python -m benchmarks.bench_decode_attention --out benchmarks/bench_decode_attention.json
    python -m benchmarks.bench_decode_attention --dtype bfloat16 --out benchmarks/bench_decode_attention_bf16.json
"""

import argparse
import functools
import json

import torch

from benchmarks.harness import timeit_each, write_json
from tests.helpers.reference import paged_decode_attention_reference
from titanrl.generator import cpu_kernel
from titanrl.generator.decode import DecodeAttention

# (block, head_dim, kv heads G, query heads per KV head R, rows N, context, threads)
SHAPES = [
    (16, 16, 1, 2, 256, 80, 1),  # the negligible model of bench_generate's overhead section
    (16, 16, 1, 2, 256, 80, 2),
    (16, 64, 2, 2, 256, 80, 2),  # the debug (bench) model
    (16, 64, 2, 2, 64, 600, 2),
    (16, 128, 2, 4, 32, 1000, 2),  # Qwen-like heads, long context
    (32, 64, 2, 2, 256, 80, 2),
]
CALLS, REPEAT = 30, 10  # each timing: CALLS calls; the best of REPEAT timings
DOC_TABLES = [("Milliseconds per call, kernel vs compiled in-place form", ["rows"], None)]


def _calls(fn, calls: int) -> None:
    for _ in range(calls):
        fn()


def bench_shape(block: int, head_dim: int, G: int, R: int, N: int, ctx: int, threads: int, dtype: torch.dtype) -> dict:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    M = -(-ctx // block)
    pages = N * M + 1
    k_pages = torch.randn(pages, G, head_dim, block, generator=g)
    v_pages = torch.randn(pages, block, G, head_dim, generator=g)
    table_NM = torch.randperm(pages - 1, generator=g)[: N * M].view(N, M).contiguous()
    pos_N = torch.randint(ctx // 2, ctx, (N,), generator=g)
    q_NGRD = torch.randn(N, G, R, head_dim, generator=g)
    k_pages, v_pages, q_NGRD = k_pages.to(dtype), v_pages.to(dtype), q_NGRD.to(dtype)
    live_N = torch.ones(N, dtype=torch.bool)

    def inplace_attention(q, k, v, table, pos):
        backend = DecodeAttention([k], [v], table, pos, live_N, pages - 1, k_transposed=True)
        return backend._attend_in_place(q, k, v)

    inplace = torch.compile(inplace_attention, dynamic=False)
    args = (q_NGRD, k_pages, v_pages, table_NM, pos_N)
    variants = {
        "kernel": lambda: cpu_kernel.paged_decode_attention(*args),
        "compiled_inplace": lambda: inplace(*args),
    }
    ref = paged_decode_attention_reference(*args)
    row = {
        "block": block,
        "head_dim": head_dim,
        "kv_heads": G,
        "q_per_kv": R,
        "rows": N,
        "ctx": ctx,
        "threads": threads,
        "dtype": str(dtype).removeprefix("torch."),
    }
    for name, fn in variants.items():
        row[f"{name}_max_err"] = (fn().double() - ref).abs().max().item()
    batches = {name: functools.partial(_calls, fn, CALLS) for name, fn in variants.items()}
    for name, timing in timeit_each(batches, warmup=0, repeat=REPEAT).items():
        row[f"{name}_ms"] = timing.min / CALLS * 1e3
    row["kernel_speedup"] = row["compiled_inplace_ms"] / row["kernel_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_decode_attention.json")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    reason = cpu_kernel.unusable_reason(torch.device("cpu"), dtype, 16, 16)
    if reason is not None:
        raise SystemExit(f"the CPU kernel cannot run here: {reason}")
    rows = []
    for shape in SHAPES:
        rows.append(bench_shape(*shape, dtype))
        print(json.dumps(rows[-1]), flush=True)
    write_json(args.out, {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows})


if __name__ == "__main__":
    main()

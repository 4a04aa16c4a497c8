"""Decode attention alone: the hand-written CPU kernel vs the compiled pure-PyTorch in-place form.

One decode step's attention over a paged pool (keys transposed, pages in random order, rows at
random positions in [ctx / 2, ctx)), for several shapes: `cpu_kernel.paged_decode_attention`
against `DecodeAttention._attend_in_place` under `torch.compile` (what `attention_impl =
"inplace"` runs). Best of 5 timings of 30 calls each, twice alternating, so the pool is warm in
cache: this isolates the kernels (in a decode step the pool is read cold more often and the
gain is smaller; `scripts/bench_generate.py` measures whole steps). Also the largest difference
of each from a float64 reference. `--dtype bfloat16`: pool and queries in bfloat16 (the kernel
widens them to float32 as it reads; the compiled form computes as PyTorch does in bfloat16).

    python scripts/bench_decode_attention.py --out benchmarks/bench_decode_attention.json
    python scripts/bench_decode_attention.py --dtype bfloat16 --out benchmarks/bench_decode_attention_bf16.json
"""

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch

from titanrl.generator import cpu_kernel
from titanrl.generator.decode import DecodeAttention
from titanrl.generator.reference import paged_decode_attention_reference

# (block, head_dim, kv heads G, query heads per KV head R, rows N, context, threads)
SHAPES = [
    (16, 16, 1, 2, 256, 80, 1),  # the negligible model of bench_generate's overhead section
    (16, 16, 1, 2, 256, 80, 2),
    (16, 64, 2, 2, 256, 80, 2),  # the debug (bench) model
    (16, 64, 2, 2, 64, 600, 2),
    (16, 128, 2, 4, 32, 1000, 2),  # Qwen-like heads, long context
    (32, 64, 2, 2, 256, 80, 2),
]


def _best_ms(fn, calls: int = 30, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


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
    times = {name: [] for name in variants}
    for _ in range(2):
        for name, fn in variants.items():
            times[name].append(_best_ms(fn))
    for name in variants:
        row[f"{name}_ms"] = min(times[name])
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
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}",
        "command": f"python scripts/bench_decode_attention.py --dtype {args.dtype}",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

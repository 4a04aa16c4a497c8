"""bench_gpu.py's generator sections beyond decode: FlexAttention next to the in-place decode
attention it replaced, prefill throughput at long prompts, a GRPO batch with a long-tail length
distribution, and compile seconds of a cold and a warm start (each in a fresh process).

`inplace_decode_attention` is the compiled in-place form the generator ran on CUDA before the
FlexAttention backend (pages indexed through the block table, products and sums that inductor
fuses, K pages stored transposed [page, head, dim, slot]); it lives here, for the comparison only.
"""

import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.harness import REPO_ROOT, timed_call, timeit
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.generator.paged_attention import FlexPagedAttention, PagedBatch, logical_page_index
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args


def inplace_decode_attention(q_NGRD, kT_pages, v_pages, table_NM, pos_N):
    """The in-place decode attention as it was (compiled by the caller): q grouped by KV head."""
    N, G, R, D = q_NGRD.shape
    B, M = v_pages.shape[1], table_NM.shape[1]
    valid_NL = torch.arange(M * B, device=pos_N.device)[None, :] <= pos_N[:, None]
    k_NMG1DB = kT_pages[table_NM].unsqueeze(3).to(q_NGRD.dtype)
    scores_NMGRB = (q_NGRD[:, None, :, :, :, None] * k_NMG1DB).sum(-2)
    scores_NLGR = scores_NMGRB.permute(0, 1, 4, 2, 3).flatten(1, 2) * D**-0.5
    scores_NLGR = scores_NLGR.masked_fill(~valid_NL[:, :, None, None], float("-inf"))
    probs_NLGR = scores_NLGR.float().softmax(1).to(q_NGRD.dtype)
    v_NLG1D = v_pages[table_NM].flatten(1, 2).unsqueeze(3).to(q_NGRD.dtype)
    return (probs_NLGR.unsqueeze(-1) * v_NLG1D).sum(1)


def flex_decode_attention(q_1NHD, k_1NGD, v_1NGD, k_pages, v_pages, table_NM, pos_N, live_N, page_index_P):
    """One layer of the generator's decode step: K/V written, FlexAttention over the pages."""
    batch = PagedBatch.decode(table_NM, pos_N, live_N, k_pages.shape[0] - 1, k_pages.shape[1], page_index_P)
    return FlexPagedAttention(batch, [k_pages], [v_pages]).attend(0, q_1NHD, k_1NGD, v_1NGD)


def attention_rows(
    args: TransformerModelArgs,
    device: torch.device,
    dtype: torch.dtype,
    batch_sizes: list[int],
    context: int,
    bw: float,
    compiled: bool = True,
) -> list[dict]:
    """One layer's decode attention at `context` positions per row: FlexAttention (the
    generator's) vs the in-place form, each compiled per batch (`compiled=False`: dynamo's eager
    backend, a dry run), ms and fraction of the time the layer's K/V bytes take at the measured
    copy bandwidth."""
    Hkv, H, D, B = args.n_kv_heads, args.n_heads, args.head_dim, 16
    backend = "inductor" if compiled else "eager"
    flex = torch.compile(flex_decode_attention, backend=backend, dynamic=False)
    inplace = torch.compile(inplace_decode_attention, backend=backend, dynamic=False)
    rows = []
    for N in batch_sizes:
        M = -(-context // B)
        P = N * M + 1
        g = torch.Generator(device=device).manual_seed(0)
        k_pages = torch.randn(P, B, Hkv, D, device=device, dtype=dtype, generator=g)
        v_pages = torch.randn(P, B, Hkv, D, device=device, dtype=dtype, generator=g)
        kT_pages = k_pages.permute(0, 2, 3, 1).contiguous()
        table_NM = torch.randperm(P - 1, device=device, generator=g)[: N * M].view(N, M)
        pos_N = torch.full((N,), context - 1, device=device)
        live_N = torch.ones(N, dtype=torch.bool, device=device)
        q = torch.randn(1, N, H, D, device=device, dtype=dtype, generator=g)
        # The new token's K/V as the pages already hold them: the write changes nothing, so both
        # forms attend over the same keys.
        slot_N = table_NM[:, (context - 1) // B] * B + (context - 1) % B
        k, v = (pages.view(-1, Hkv, D)[slot_N][None] for pages in (k_pages, v_pages))
        page_index = logical_page_index(table_NM, P - 1, P)
        calls = {
            "flex": functools.partial(flex, q, k, v, k_pages, v_pages, table_NM, pos_N, live_N, page_index),
            "inplace": functools.partial(inplace, q[0].view(N, Hkv, H // Hkv, D), kT_pages, v_pages, table_NM, pos_N),
        }
        ref = calls["inplace"]().reshape(N, H, D).float()
        err = (calls["flex"]()[0].float() - ref).abs().max().item()
        kv_bytes = 2 * N * context * Hkv * D * k_pages.element_size()
        row = {"batch": N, "context": context, "max_abs_diff": err}
        for name, call in calls.items():
            seconds = timeit(call, warmup=2, repeat=20, device=device).median
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_fraction_of_roofline"] = kv_bytes / bw / seconds
        row["flex_speedup"] = row["inplace_ms"] / row["flex_ms"]
        rows.append(row)
        print(f"  attention batch {N}: flex {row['flex_ms']:.3f} ms, in-place {row['inplace_ms']:.3f} ms", flush=True)
    return rows


def prefill_rows(gen: Generator, vocab: int, lengths: list[int], tokens_per_call: int, device) -> list[dict]:
    """Prefill tokens/s of prompts of each length (as many as fill `tokens_per_call`), one new
    token each; the first call (compilation of this shape) is not timed."""
    rows, g = [], torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    for L in lengths:
        prompts = torch.randint(0, vocab, (max(1, tokens_per_call // L), L), generator=g).tolist()
        _, first = gen.generate(prompts, params)
        seconds, (_, stats) = timed_call(functools.partial(gen.generate, prompts, params), device)
        n = len(prompts) * L
        rows.append(
            {
                "prompt_len": L,
                "prompts": len(prompts),
                "prefill_tok_s": n / seconds,
                "first_compile_s": first.compile_seconds,
            }
        )
        print(f"  prefill {len(prompts)} x {L}: {n / seconds:,.0f} tok/s", flush=True)
    return rows


def long_tail_batch(gen: Generator, vocab: int, prompts: int, group: int, max_new: int, device) -> dict:
    """A GRPO batch at temperature 1 whose lengths have a long tail: 1 token in 64 stops a sample
    (random weights), so lengths are geometric (mean ~64) up to `max_new`."""
    g = torch.Generator().manual_seed(2)
    batch = torch.randint(0, vocab, (prompts, 128), generator=g).tolist()
    params = SamplingParams(
        max_new_tokens=max_new, temperature=1.0, n=group, seed=0, stop_token_ids=list(range(0, vocab, 64))
    )
    gen.generate(batch, params)  # warm-up: the buckets the tail walks down through
    seconds, (completions, stats) = timed_call(functools.partial(gen.generate, batch, params), device)
    lengths = sorted(len(c.token_ids) for c in completions)
    q = statistics.quantiles(lengths, n=10)
    out = {
        "samples": len(lengths),
        "max_new_tokens": max_new,
        "len_p50": statistics.median(lengths),
        "len_p90": q[-1],
        "len_max": lengths[-1],
        "generate_s": seconds,
        "tok_s": stats.decode_tokens / seconds,
        "decode_steps": stats.decode_steps,
        "scheduler_passes": stats.scheduler_passes,
        "compile_s": stats.compile_seconds,
    }
    print(f"  long tail: p50 {out['len_p50']}, max {out['len_max']}, {out['tok_s']:,.0f} tok/s", flush=True)
    return out


def compile_worker(cfg: dict) -> dict:
    """A fresh process: the generator of `cfg['flavor']` (random weights, generator settings
    `cfg['generator']`) decodes batches of `cfg['batches']` prompts, in order (the same shapes as
    the decode section's first batches, so the same graphs); compile seconds and wall time."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = get_model_args(cfg["flavor"])
    start = time.perf_counter()
    gen = Generator(args, GeneratorConfig(**cfg["generator"]), device, dtype=getattr(torch, cfg["dtype"]))
    compile_s = generate_s = 0.0
    for batch in cfg["batches"]:
        prompts = torch.randint(0, args.vocab_size, (batch, cfg["prompt_len"])).tolist()
        _, stats = gen.generate(prompts, SamplingParams(max_new_tokens=cfg["new_tokens"], temperature=0.0))
        compile_s, generate_s = compile_s + stats.compile_seconds, generate_s + stats.seconds
    return {"compile_s": compile_s, "generate_s": generate_s, "wall_s": time.perf_counter() - start}


def warm_compile(cfg: dict, timeout_s: float, cuda: bool) -> dict | str:
    """`compile_worker` in a new process over this run's compile cache (TORCHINDUCTOR_CACHE_DIR,
    which the same generation in this process filled): what a restarted job pays."""
    env = {**os.environ, **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})}
    cmd = [sys.executable, "-m", "benchmarks.gpu_generator", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"skipped: over its time cap of {timeout_s:.0f} s"
    if proc.returncode:
        return f"failed: exit code {proc.returncode}: {proc.stderr[-800:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  compile, warm cache in a new process: {out['compile_s']:.1f} s", flush=True)
    return out


if __name__ == "__main__":  # warm_compile's worker process
    print(json.dumps(compile_worker(json.loads(sys.argv[1]))), flush=True)


def generator_sections(
    name: str, args: TransformerModelArgs, device, dtype, gen_cfg: dict, compile: bool | None, left, a
) -> dict:
    """Prefill tokens/s at long prompts and a long-tail GRPO batch on one generator of `name`, then
    the compile seconds of the decode section's first batches (`compile_batches`, in order) in a
    new process over this run's compile cache (warm), each while the budget lasts."""
    out: dict = {"model": name}
    cuda = device.type == "cuda"
    if left() < 60:
        return {**out, "skipped": f"{left():.0f} s left of the {a.budget_s:.0f} s budget"}
    print(f"generator sections ({name}):", flush=True)
    prompts, group, max_new = gen_cfg["tail"]
    config = GeneratorConfig(
        block_size=16,
        num_blocks=max(4 * gen_cfg["prefill_tokens"], prompts * group * 24) // 16,
        max_num_seqs=prompts * group,
        max_num_batched_tokens=gen_cfg["prefill_tokens"],
        compile=compile,
    )
    gen = Generator(args, config, device, dtype=dtype)
    lens, tokens = gen_cfg["prefill_lens"], gen_cfg["prefill_tokens"]
    out["prefill"] = prefill_rows(gen, args.vocab_size, lens, tokens, device)
    out["long_tail"] = (
        long_tail_batch(gen, args.vocab_size, prompts, group, max_new, device) if left() > 60 else "skipped: budget"
    )
    gen.sleep()
    del gen
    if cuda:
        torch.cuda.empty_cache()
    worker = {
        "flavor": name,
        "dtype": str(dtype).removeprefix("torch."),
        "generator": {**gen_cfg["decode"], "compile": False if a.dry_run else compile},
        "batches": gen_cfg["compile_batches"],
        "prompt_len": gen_cfg["prompt_len"],
        "new_tokens": gen_cfg["new_tokens"],
    }
    cap = min(120.0, left() - 10)
    if a.dry_run:  # the worker's code, in this process (a new one costs seconds of CI time)
        out["warm_compile"] = {**compile_worker(worker), "dry_run": "uncompiled, in this process"}
    elif cap > 20:
        result = warm_compile(worker, cap, cuda)
        out["warm_compile"] = result if isinstance(result, dict) else {"result": result}
    else:
        out["warm_compile"] = {"result": f"skipped: {left():.0f} s left of the {a.budget_s:.0f} s budget"}
    return out

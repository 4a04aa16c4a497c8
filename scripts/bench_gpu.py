"""Single-GPU benchmark: generator decode throughput against the memory-bandwidth roofline,
training MFU, and trainer -> generator weight-sync time, for Qwen2.5-0.5B / 1.5B shapes with
random weights. One JSON out. Run through `scripts/bench_gpu.sh`; `--dry-run` runs the same
code on a tiny model on CPU (what CI tests).

Roofline of one decode step of a batch of b sequences at context c:
    bytes = weight bytes + b * c * (KV bytes per token, all layers)
    t_min = bytes / measured device copy bandwidth,   roofline tok/s = b / t_min
MFU = (6 * params * tokens + attention FLOPs) / step time / peak bf16 FLOP/s (H200: 989e12 dense).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from titanrl.config.rl_sections import Generator as GeneratorConfig  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.models.args import TransformerModelArgs  # noqa: E402
from titanrl.models.flavors import get_model_args  # noqa: E402
from titanrl.models.model import Transformer  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_on(args: TransformerModelArgs, device: torch.device) -> Transformer:
    """Random-weight model materialised directly on `device` (no host copy of a large model)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)
    return model


def count_params(args: TransformerModelArgs) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(args).parameters())


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 5)
    return 2 * nbytes / seconds


def kv_bytes_per_token(args: TransformerModelArgs, dtype: torch.dtype) -> int:
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * torch.empty(0, dtype=dtype).element_size()


def bench_decode(args: TransformerModelArgs, device: torch.device, dtype: torch.dtype, batch_sizes: list[int],
                 prompt_len: int, new_tokens: int, bandwidth: float, compile: bool) -> list[dict]:
    max_batch = max(batch_sizes)
    block = 16
    blocks = max_batch * ((prompt_len + new_tokens) // block + 2)
    config = GeneratorConfig(block_size=block, num_blocks=blocks, max_num_seqs=max_batch,
                             max_num_batched_tokens=max(4096, prompt_len * 8), enable_prefix_caching=False,
                             compile=compile)
    gen = Generator(args, config, device, dtype=dtype)
    gen.wake()
    weight_bytes = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        prompts = torch.randint(0, args.vocab_size, (b, prompt_len), generator=g).tolist()

        def run(n):
            _, stats = gen.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))
            return stats

        run(new_tokens)  # warm-up (and compilation of this batch bucket)
        sync(device)
        start = time.perf_counter()
        stats = run(new_tokens)
        sync(device)
        total = time.perf_counter() - start
        start = time.perf_counter()
        run(1)  # prefill (+ one token) alone, to take out of the decode time
        sync(device)
        prefill = time.perf_counter() - start
        decode_s = max(total - prefill, 1e-9)
        decode_tokens = b * (new_tokens - 1)
        mean_ctx = prompt_len + new_tokens / 2
        step_bytes = weight_bytes + b * mean_ctx * kv_bytes_per_token(args, dtype)
        roofline = b / (step_bytes / bandwidth)
        achieved = decode_tokens / decode_s
        rows.append({"batch": b, "decode_tok_s": achieved, "roofline_tok_s": roofline,
                     "fraction_of_roofline": achieved / roofline, "prefill_s": prefill,
                     "decode_steps": stats.steps})
        print(f"  decode batch {b}: {achieved:,.0f} tok/s = {achieved / roofline:.1%} of roofline", flush=True)
    gen.sleep()
    return rows


def bench_train(args: TransformerModelArgs, device: torch.device, batch: int, seq: int, peak: float | None,
                reps: int) -> dict:
    torch.manual_seed(0)
    model = build_on(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()

    seconds = timed(step, device, reps)
    n_params = sum(p.numel() for p in model.parameters())
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq * seq * batch / 2  # causal
    flops = 6 * n_params * batch * seq + attention
    out = {"batch": batch, "seq": seq, "step_s": seconds, "tokens_per_s": batch * seq / seconds,
           "tflops": flops / seconds / 1e12, "mfu": flops / seconds / peak if peak else None}
    del model, opt
    return out


def bench_sync(args: TransformerModelArgs, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    trainer = build_on(args, device)
    gen = Generator(args, GeneratorConfig(num_blocks=4), device, dtype=dtype)
    seconds = timed(lambda: gen.load_weights(trainer), device, reps)
    nbytes = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    return {"sync_s": seconds, "generator_weight_bytes": nbytes, "bytes_per_s": nbytes / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, a few steps (CI)")
    p.add_argument("--out", default="benchmarks/bench_gpu.json")
    p.add_argument("--compile", action="store_true", help="compiled decode (CUDA graphs); longer warm-up")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if a.dry_run:
        models = {"debug": get_model_args("debug")}
        batch_sizes, prompt_len, new_tokens, dtype = [1, 4], 16, 8, torch.float32
        train_shape, reps, bw_bytes = (2, 32), 2, 32 * 2**20
    else:
        models = {name: get_model_args(name) for name in ("qwen2.5-0.5b", "qwen2.5-1.5b")}
        batch_sizes, prompt_len, new_tokens, dtype = [1, 16, 64, 256], 128, 128, torch.bfloat16
        train_shape, reps, bw_bytes = (8, 1024), 5, 2**30
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None) if cuda else None
    start = time.perf_counter()
    bandwidth = copy_bandwidth(device, bw_bytes)
    print(f"device {name}: copy bandwidth {bandwidth / 1e9:,.1f} GB/s", flush=True)
    report = {
        "benchmark": "single-device generator decode vs roofline, training MFU, weight sync",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "device": name, "dry_run": a.dry_run,
        "torch": torch.__version__, "command": "bash scripts/bench_gpu.sh " + " ".join(sys.argv[1:]),
        "copy_bandwidth_gb_s": bandwidth / 1e9, "peak_bf16_tflops": peak / 1e12 if peak else None,
        "config": {"prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": str(dtype),
                   "compile": a.compile, "train_batch_seq": list(train_shape)},
        "models": {},
    }
    for model_name, args in models.items():
        print(f"{model_name}:", flush=True)
        entry = {"params": count_params(args)}
        entry["decode"] = bench_decode(args, device, dtype, batch_sizes, prompt_len, new_tokens, bandwidth, a.compile)
        entry["train"] = bench_train(args, device, *train_shape, peak, reps)
        print(f"  train: {entry['train']['tokens_per_s']:,.0f} tok/s, MFU {entry['train']['mfu']}", flush=True)
        entry["weight_sync"] = bench_sync(args, device, dtype, reps)
        print(f"  weight sync: {entry['weight_sync']['sync_s'] * 1e3:.1f} ms", flush=True)
        report["models"][model_name] = entry
        if cuda:
            torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out} in {report['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Two gpt-oss-20b-shaped layers on one GPU (`scripts/bench_gpu.sh --gpt-oss`): generator decode
tok/s at batch 1 / 64 / 256 against the bandwidth roofline, and a training step's tokens/s and
MFU of the active parameters. Random weights, bf16 generator (compiled on CUDA, its default),
bf16 autocast training with float32 AdamW state.

    python -m benchmarks.bench_gpt_oss --out benchmarks/bench_gpt_oss_gpu.json   # on a GPU
    python -m benchmarks.bench_gpt_oss --dry-run                                 # CPU, debug-gpt-oss

The model is `benchmarks.shapes.GPT_OSS_20B_2L` (dry run: the `debug-gpt-oss` flavor). Decode
rows are `bench_gpu.bench_decode`'s (decode tok/s from a generation of `--new-tokens` less one of
1 token; the roofline reads every weight, experts included, and every KV byte once per step; at
batch 1 a token reads 4 of the 32 experts, so it can beat that roofline). Prompts are longer
than the 128-token window. Training MFU = (6 * active * tokens + attention FLOPs) / step time /
peak bf16 FLOP/s, where `active` counts the parameters a token's matmuls use (the routed
experts it picks, not the embedding lookup) and attention FLOPs count each query's visible keys
(the window on sliding layers, the causal prefix on full ones).
"""

import argparse
import json
import time

import torch

from benchmarks.bench_gpu import PEAK_BF16_FLOPS, bench_decode, bench_train, copy_bandwidth, count_params
from benchmarks.bench_moe import active_params
from benchmarks.harness import write_json
from benchmarks.shapes import GPT_OSS_20B_2L
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

# (batch sizes, prompt length, new tokens, train batch x seq, timing repeats)
GPU_SIZES = ([1, 64, 256], 512, 64, (2, 2048), 3)
DRY_RUN_SIZES = ([1, 4], 40, 4, (2, 48), 1)


DOC_TABLES = [
    ("Decode vs the bandwidth roofline", ["decode"], None),
    ("Training step (MFU of the active parameters)", ["train"], None),
]


def matmul_active_params(args: TransformerModelArgs) -> int:
    """Parameters a token's matmuls use: the active ones less the embedding table (a lookup)."""
    with torch.device("meta"):
        model = Transformer(args)
    return active_params(model) - model.tok_embeddings.weight.numel()


def attention_flops(args: TransformerModelArgs, batch: int, seq: int) -> float:
    """Forward + backward FLOPs of the score and value matmuls (4 * head_dim per query-key pair
    and head forward, x3 with backward) over each query's visible keys."""
    pairs = 0
    for layer in range(args.n_layers):
        window = args.sliding_window if args.layer_types[layer] == "sliding_attention" else 0
        pairs += sum(min(t + 1, window) if window else t + 1 for t in range(seq))
    return 12 * args.n_heads * args.head_dim * pairs * batch


def train_entry(args: TransformerModelArgs, device, shape: tuple[int, int], peak: float | None, reps: int) -> dict:
    batch, seq = shape
    row = bench_train(args, device, batch, seq, peak, reps)
    flops = 6 * matmul_active_params(args) * batch * seq + attention_flops(args, batch, seq)
    row["tflops"] = flops / row["step_s"] / 1e12
    row["mfu"] = flops / row["step_s"] / peak if peak else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="debug-gpt-oss on the CPU, small sizes")
    parser.add_argument("--out", default="", help="write the JSON report here (default: print it only)")
    a = parser.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    name, args = ("debug-gpt-oss", get_model_args("debug-gpt-oss")) if a.dry_run else ("gpt-oss-20b-2l", GPT_OSS_20B_2L)
    batches, prompt_len, new_tokens, train_shape, reps = DRY_RUN_SIZES if a.dry_run else GPU_SIZES
    peak = (
        next((v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name(device)), None) if cuda else None
    )
    start = time.perf_counter()
    bandwidth = copy_bandwidth(device, 1 << 30 if cuda else 1 << 24)
    dtype = torch.bfloat16 if cuda else torch.float32
    print(f"{name}: {count_params(args) / 1e9:.2f}B params, {matmul_active_params(args) / 1e9:.3f}B active", flush=True)
    report = {
        "model": name,
        "dry_run": a.dry_run,
        "params": count_params(args),
        "matmul_active_params": matmul_active_params(args),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "config": {"prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": str(dtype), "train": train_shape},
    }
    report["decode"] = bench_decode(args, device, dtype, batches, prompt_len, new_tokens, bandwidth, None)
    if cuda:
        torch.cuda.empty_cache()
    report["train"] = train_entry(args, device, train_shape, peak, reps)
    print(f"  train: {report['train']['tokens_per_s']:,.0f} tok/s, MFU {report['train']['mfu']}", flush=True)
    report["wall_s"] = time.perf_counter() - start
    if a.out:
        write_json(a.out, report)
    print(json.dumps({"gpt_oss_bench": report}), flush=True)


if __name__ == "__main__":
    main()

"""Two DeepSeek-V3-shaped layers on one GPU (`scripts/bench_gpu.sh --deepseek-only`): generator
decode tok/s at batch 1 / 64 / 256 over the compressed-latent KV cache against the bandwidth
roofline, and the training MFU of the active parameters. The shape: `benchmarks.shapes.deepseek_v3_2l`
(one dense and one MoE layer of DeepSeek-V3-671B, 16 routed experts so that float32 AdamW state
fits; top-8, so a token's compute is the real layers'). The roofline's bytes per decode step: the
weights a step reads (all but the routed experts, plus the distinct experts `batch` tokens pick
in expectation, E (1 - (1 - k/E)^batch)) and every sequence's latent cache,
n_layers (kv_lora_rank + qk_rope_head_dim) bytes-per-element a token. `--dry-run`: the
debug-deepseek-v3 flavor on the CPU at batch 1 / 4, a few tokens (tests/test_deepseek_v3.py).

    python -m benchmarks.bench_deepseek_gpu [--dry-run] [--out benchmarks/bench_deepseek_gpu.json] [--eager]
"""

import argparse
import platform

import torch

from benchmarks.bench_gpu import PEAK_BF16_FLOPS, bench_train, copy_bandwidth, decode_config
from benchmarks.gpu_workers import time_decode
from benchmarks.harness import command_line, write_json
from benchmarks.shapes import deepseek_v3_2l
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args

DOC_TABLES = [
    ("Decode over the latent cache vs the bandwidth roofline", ["decode"], None),
    ("Training step (MFU of the active parameters)", ["train"], None),
]


def latent_bytes_per_token(args: TransformerModelArgs, dtype: torch.dtype) -> int:
    """MLA's cache: one latent [c, k_pe] per token and layer (docs/models.md)."""
    return args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * torch.empty(0, dtype=dtype).element_size()


def weight_bytes_per_step(gen: Generator, batch: int) -> float:
    """Bytes of the weights one decode step of `batch` tokens reads: the routed experts only as
    many as the batch picks in expectation (uniform routing)."""
    args, total, experts = gen.args, 0.0, 0.0
    for name, p in gen.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".moe.experts." in name:
            experts += nbytes
        else:
            total += nbytes
    picked = 1 - (1 - args.moe_top_k / args.moe_num_experts) ** batch
    return total + experts * picked


def decode_rows(args, device, dtype, batch_sizes, prompt_len, new_tokens, bandwidth, compile) -> list[dict]:
    config = GeneratorConfig(**decode_config(max(batch_sizes), prompt_len, new_tokens, compile))
    gen = Generator(args, config, device, dtype=dtype)
    gen.wake()
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        prompts = torch.randint(0, args.vocab_size, (b, prompt_len), generator=g).tolist()

        def run(n: int, prompts=prompts):
            return gen.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))[1]

        timing, stats = time_decode(run, b, new_tokens, device)
        step_bytes = weight_bytes_per_step(gen, b) + b * (prompt_len + new_tokens / 2) * latent_bytes_per_token(
            args, dtype
        )
        roofline = b / (step_bytes / bandwidth)
        rows.append(
            {
                "batch": b,
                "decode_tok_s": timing["decode_tok_s"],
                "roofline_tok_s": roofline,
                "fraction_of_roofline": timing["decode_tok_s"] / roofline,
                "prefill_s": timing["prefill_s"],
                "decode_steps": stats.steps,
            }
        )
        print(f"  decode batch {b}: {timing['decode_tok_s']:,.0f} tok/s = {rows[-1]['fraction_of_roofline']:.1%}")
    gen.sleep()
    return rows


def train_row(args: TransformerModelArgs, device, batch: int, seq: int, peak: float | None, reps: int) -> dict:
    """One training step (`bench_gpu.bench_train`: bf16 autocast on CUDA, float32 AdamW) with MLA's
    FLOPs: 6 x active parameters a token, plus causal attention, whose scores use qk_nope + qk_rope
    dims and values v_head_dim."""
    row = bench_train(args, device, batch, seq, peak, reps)
    qk_v = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    attention = 6 * args.n_layers * args.n_heads * qk_v * seq * seq * batch / 2
    flops = 6 * row["active_params"] * batch * seq + attention
    row["tflops"] = flops / row["step_s"] / 1e12
    row["mfu"] = flops / row["step_s"] / peak if peak else None
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the debug flavor on CPU, a few steps (CI)")
    p.add_argument("--out", default="benchmarks/bench_deepseek_gpu.json")
    p.add_argument("--eager", action="store_true", help="the generator uncompiled (compiled on CUDA by default)")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if a.dry_run:
        name, args, dtype, batches, prompt_len, new_tokens = (
            "debug-deepseek-v3",
            get_model_args("debug-deepseek-v3"),
            torch.float32,
            [1, 4],
            16,
            8,
        )
        train_shape, reps, bw_bytes = (2, 32), 2, 32 * 2**20
    else:
        name, args, dtype, batches, prompt_len, new_tokens = (
            "deepseek-v3-2l",
            deepseek_v3_2l(),
            torch.bfloat16,
            [1, 64, 256],
            128,
            128,
        )
        train_shape, reps, bw_bytes = (4, 1024), 3, 2**30
    device_name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None) if cuda else None
    bandwidth = copy_bandwidth(device, bw_bytes)
    print(f"{name} on {device_name}: copy bandwidth {bandwidth / 1e9:,.1f} GB/s", flush=True)
    report = {"model": name, "dry_run": a.dry_run, "copy_bandwidth_gb_s": bandwidth / 1e9, "peak_flops": peak}
    report["latent_bytes_per_token"] = latent_bytes_per_token(args, dtype)
    compile = False if a.eager else None
    report["decode"] = decode_rows(args, device, dtype, batches, prompt_len, new_tokens, bandwidth, compile)
    if cuda:
        torch.cuda.empty_cache()
    report["train"] = train_row(args, device, *train_shape, peak, reps)
    print(f"  train: {report['train']['tokens_per_s']:,.0f} tok/s, MFU {report['train']['mfu']}", flush=True)
    write_json(a.out, report, command=command_line(), device=device)


if __name__ == "__main__":
    main()

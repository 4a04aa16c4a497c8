"""Single-GPU benchmark: generator decode throughput against the memory-bandwidth roofline
(FlexAttention next to the in-place decode attention it replaced), prefill throughput, a
long-tail GRPO batch, compile seconds cold and warm, training MFU and weight-sync time, for
Qwen2.5-0.5B / 1.5B shapes with random weights; then a GRPO step of a real recipe split by phase,
and decode next to vLLM's. One JSON out, rewritten after each section (a run cut short keeps what
it measured). Run through `scripts/bench_gpu.sh`; `--dry-run` runs the same code on a tiny model
on CPU (what CI tests). The generator runs with its defaults (compiled on CUDA; `--eager` not).

Roofline of one decode step of a batch of b sequences at context c:
    bytes = weight bytes + b * c * (KV bytes per token, all layers)
    t_min = bytes / measured device copy bandwidth,   roofline tok/s = b / t_min
Decode tok/s = b * (new_tokens - 1) / (time of a generation of new_tokens - time of one of 1
token), greedy, every sample runs to new_tokens; `tok_s` is b * new_tokens / the whole call;
`compile_s` the batch's first generation's compile seconds (its bucket: cold, this run's cache
folder starts empty). MFU = (6 * params * tokens + attention FLOPs) / step time / peak bf16
FLOP/s (H200: 989e12 dense).

`decode_attention` (per model): one layer's decode attention over 1,024 positions per row,
FlexAttention as the generator runs it (block mask built in the compiled region) vs the compiled
in-place form (`benchmarks/gpu_generator.py`), ms each and the fraction of the K/V bytes' time
at the copy bandwidth.

`generator` (first model): prefill tokens/s of 2k and 8k prompts (16k tokens a call), a GRPO
batch of 32 prompts x 8 samples at temperature 1 whose lengths have a long tail (1 token in 64
stops a sample, capped at 1,024), and `warm_compile`: the decode section's batch-16 generation
in a new process over this run's compile cache (what a restarted job pays), next to the same
generation's cold compile seconds in this process.

`moe` (after the first model's sections, before the other models, while `--model-min-s` is
left): the same decode / train / sync entry for a mixture-of-experts model: two layers of the
Qwen3-30B-A3B shape (128 experts of width 768, top-8, dim 2048, its vocabulary, untied head:
1.87B parameters, 0.74B active per token, so float32 AdamW state fits one GPU), `debug-moe` in
a dry run. Its MFU counts the active parameters (6 * active * tokens); its decode roofline
reads every expert (at batch 16 and up the tokens' top-8 choices cover nearly all 128).

`rl_step`: `python -m titanrl.train` on `train_configs/grpo_reverse_debug.toml` through
`benchmarks/bench_rl_step.py` (its assets and runner) with the recipe's own settings (the
generator compiled on CUDA): a character tokenizer, reverse-task prompts,
and a random-weight model of the `qwen2.5-0.5b` flavor's shape written as an HF folder (dry run:
the `debug` flavor's); the first step is dropped, the median seconds per phase (sync, generate,
reward, logprob, train) of the rest are reported, from the run's metrics.jsonl.

`vllm`: vLLM's offline `LLM` on the same HF folder (bf16, `skip_tokenizer_init`, token-id
prompts of the same length, greedy, `ignore_eos`, prefix caching off, as titanrl's decode above),
batch 1 / 64 / 256, next to titanrl's rows with ratios titanrl / vLLM. `"not installed"` when
there is no vllm package, otherwise a string saying why it did not run (dry run, budget, time
cap, error). It runs last, in its own process group under its own time cap (start-up with CUDA
graph capture takes a minute or more), and that process's exit frees its GPU memory; the RL step
runs the same way. `--budget-s` (bench_gpu.sh passes 540 under its 570 s `timeout`) caps the
whole run. Order: the first model, the generator sections, the MoE model, the other models
(each only with `--model-min-s` left), the RL step, vLLM; what the budget cut says so in the JSON.
"""

import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import platform
import shutil
import signal
import tempfile
import time
from types import SimpleNamespace

import torch

from benchmarks.bench_moe import active_params
from benchmarks.gpu_generator import attention_rows, generator_sections
from benchmarks.gpu_workers import on_sigterm, rl_step_section, time_decode, vllm_section, worker_main
from benchmarks.harness import command_line, environment, timeit, write_json
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.hf import export_hf
from titanrl.models.model import Transformer

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
VLLM_MODEL = "qwen2.5-0.5b"  # compared with vLLM, and the RL step's shape on a GPU
# The `moe` section's model on a GPU: two Qwen3-30B-A3B layers (training state fits one device).
MOE_MODEL = ("qwen3-30b-a3b-2l", dataclasses.replace(get_model_args("qwen3-30b-a3b"), n_layers=2))
DOC_TABLES = [
    ("Decode vs the bandwidth roofline", ["models", "*", "decode"], None),
    ("Decode attention alone: FlexAttention vs the in-place form", ["models", "*", "decode_attention"], None),
    ("Prefill tokens/s", ["generator", "prefill"], None),
    ("GRPO batch with a long-tail length distribution", ["generator", "long_tail"], None),
    ("Compile seconds, warm cache in a new process", ["generator", "warm_compile"], None),
    ("Training step and weight sync", ["models"], ["params", "train.*", "weight_sync.*"]),
    ("MoE model: training step and weight sync", ["moe"], ["model", "params", "train.*", "weight_sync.*"]),
    ("MoE model: decode vs the bandwidth roofline", ["moe", "decode"], None),
    ("GRPO step, median seconds per phase", ["rl_step", "phases_s"], None),
    ("Decode next to vLLM", ["vllm", "vs_titanrl"], None),
    ("Float8 training step (bench_gpu.sh's float8 section)", ["float8_bench"], None),
]


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
    seconds = timeit(functools.partial(dst.copy_, src), warmup=1, repeat=5, device=device).median
    return 2 * nbytes / seconds


def kv_bytes_per_token(args: TransformerModelArgs, dtype: torch.dtype) -> int:
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * torch.empty(0, dtype=dtype).element_size()


def _generate(gen: Generator, prompts: list[list[int]], n: int):
    """Greedy generation of `n` tokens for every prompt; the generator's stats."""
    _, stats = gen.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))
    return stats


def decode_config(max_batch: int, prompt_len: int, new_tokens: int, compile: bool | None) -> dict:
    """The decode section's generator settings (also the warm-compile worker's: same graphs)."""
    block = 16
    return {
        "block_size": block,
        "num_blocks": max_batch * ((prompt_len + new_tokens) // block + 2),
        "max_num_seqs": max_batch,
        "max_num_batched_tokens": max(4096, prompt_len * 8),
        "enable_prefix_caching": False,
        "compile": compile,
    }


def bench_decode(
    args: TransformerModelArgs,
    device: torch.device,
    dtype: torch.dtype,
    batch_sizes: list[int],
    prompt_len: int,
    new_tokens: int,
    bandwidth: float,
    compile: bool | None,
) -> list[dict]:
    """Decode tok/s per batch vs the roofline; `compile_s`: the batch's first generation's
    compile seconds (its bucket's decode step and prefill shape, cold unless an earlier batch
    shared them)."""
    config = GeneratorConfig(**decode_config(max(batch_sizes), prompt_len, new_tokens, compile))
    gen = Generator(args, config, device, dtype=dtype)
    gen.wake()
    weight_bytes = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        prompts = torch.randint(0, args.vocab_size, (b, prompt_len), generator=g).tolist()
        compile_s = _generate(gen, prompts, new_tokens).compile_seconds
        timing, stats = time_decode(functools.partial(_generate, gen, prompts), b, new_tokens, device)
        mean_ctx = prompt_len + new_tokens / 2
        step_bytes = weight_bytes + b * mean_ctx * kv_bytes_per_token(args, dtype)
        roofline = b / (step_bytes / bandwidth)
        achieved = timing["decode_tok_s"]
        rows.append(
            {
                "batch": b,
                "decode_tok_s": achieved,
                "roofline_tok_s": roofline,
                "fraction_of_roofline": achieved / roofline,
                "prefill_s": timing["prefill_s"],
                "generate_s": timing["generate_s"],
                "tok_s": timing["tok_s"],
                "decode_steps": stats.steps,
                "compile_s": compile_s,
            }
        )
        print(f"  decode batch {b}: {achieved:,.0f} tok/s = {achieved / roofline:.1%} of roofline", flush=True)
    gen.sleep()
    return rows


def bench_train(
    args: TransformerModelArgs, device: torch.device, batch: int, seq: int, peak: float | None, reps: int
) -> dict:
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

    seconds = timeit(step, warmup=1, repeat=reps, device=device).median
    n_params = active_params(model)  # all of a dense model's; an MoE token's routed experts only
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq * seq * batch / 2  # causal
    flops = 6 * n_params * batch * seq + attention
    out = {
        "batch": batch,
        "seq": seq,
        "active_params": n_params,
        "step_s": seconds,
        "tokens_per_s": batch * seq / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
    }
    return out  # the model and optimizer go with this frame (the caller empties the CUDA cache)


def bench_sync(args: TransformerModelArgs, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    trainer = build_on(args, device)
    gen = Generator(args, GeneratorConfig(num_blocks=4), device, dtype=dtype)
    seconds = timeit(functools.partial(gen.load_weights, trainer), warmup=1, repeat=reps, device=device).median
    nbytes = sum(p.numel() * p.element_size() for p in gen.model.parameters())
    return {"sync_s": seconds, "generator_weight_bytes": nbytes, "bytes_per_s": nbytes / seconds}


def make_rl_assets(workdir: str, args: TransformerModelArgs, n_prompts: int) -> tuple[str, str]:
    """bench_rl_step's character tokenizer and reverse-task prompts, with a random model of shape
    `args` in bf16 as the HF folder (config.json + model.safetensors) that titanrl and vLLM load."""
    from benchmarks.bench_rl_step import make_assets

    folder, jsonl = make_assets(workdir, n_prompts=n_prompts, seed=0)
    torch.manual_seed(0)
    model = build_on(args, torch.device("cpu"))
    export_hf(model, folder, dtype=torch.bfloat16)  # replaces make_assets' debug-shaped model
    del model
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tokenizer's ids, as make_assets sets
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return folder, jsonl


def model_entry(
    name: str,
    args: TransformerModelArgs,
    *,
    device,
    dtype,
    batch_sizes,
    prompt_len,
    new_tokens,
    bandwidth,
    compile,
    attention: tuple,
    train: tuple,
) -> dict:
    """One model's decode rows, decode attention (FlexAttention vs in-place), training MFU and
    weight sync."""
    print(f"{name}:", flush=True)
    entry = {"params": count_params(args)}
    entry["decode"] = bench_decode(args, device, dtype, batch_sizes, prompt_len, new_tokens, bandwidth, compile)
    att_batches, context, compiled = attention
    entry["decode_attention"] = attention_rows(args, device, dtype, att_batches, context, bandwidth, compiled)
    (train_batch, train_seq), peak, reps = train
    entry["train"] = bench_train(args, device, train_batch, train_seq, peak, reps)
    print(f"  train: {entry['train']['tokens_per_s']:,.0f} tok/s, MFU {entry['train']['mfu']}", flush=True)
    entry["weight_sync"] = bench_sync(args, device, dtype, reps)
    print(f"  weight sync: {entry['weight_sync']['sync_s'] * 1e3:.1f} ms", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, a few steps (CI)")
    p.add_argument("--out", default="benchmarks/bench_gpu.json")
    p.add_argument("--eager", action="store_true", help="the generator uncompiled (compiled on CUDA by default)")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the default now; old command lines
    p.add_argument(
        "--models",
        default=f"{VLLM_MODEL},qwen2.5-1.5b",
        help="flavors of the decode / train / sync sections on a GPU (vLLM compares with the first)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds for the whole run: the RL step and vLLM get at most what is left of it",
    )
    p.add_argument("--rl-timeout", type=float, default=180.0, help="time cap of the RL step run (seconds)")
    p.add_argument("--vllm-timeout", type=float, default=240.0, help="time cap of the vLLM run, start-up included")
    p.add_argument(
        "--vllm-min-s",
        type=float,
        default=90.0,
        help="skip vLLM when less than this is left of the budget (start-up alone takes about a minute)",
    )
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no CUDA graphs)")
    p.add_argument("--model-min-s", type=float, default=200.0, help="start another model only with this much left")
    p.add_argument("--worker", choices=["rl_step", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    return p.parse_args()


def run_sizes(a: argparse.Namespace) -> SimpleNamespace:
    """The models and sizes of a run: a GPU's, or the dry run's (the debug model, on the CPU)."""
    if a.dry_run:
        s = SimpleNamespace(models={"debug": get_model_args("debug")}, batch_sizes=[1, 4], prompt_len=16)
        s.new_tokens, s.dtype, s.train_shape, s.reps, s.bw_bytes = 8, torch.float32, (2, 32), 2, 32 * 2**20
        s.attention_context, s.rl_flavor = 64, "debug"
        s.rl = {"steps": 2, "batch_size": 2, "group_size": 4, "max_new_tokens": 8, "threads": 1}
        s.gen_cfg = {"prefill_lens": [32, 64], "prefill_tokens": 128, "tail": (2, 4, 32), "compile_batches": [1, 4]}
    else:
        models = {name: get_model_args(name) for name in a.models.split(",") if name}
        s = SimpleNamespace(models=models, batch_sizes=[1, 16, 64, 256], prompt_len=128)
        s.new_tokens, s.dtype, s.train_shape, s.reps, s.bw_bytes = 128, torch.bfloat16, (8, 1024), 5, 2**30
        s.attention_context, s.rl_flavor = 1024, VLLM_MODEL
        s.rl = {"steps": 3, "batch_size": 8, "group_size": 8, "max_new_tokens": 64, "threads": 4}
        s.gen_cfg = {
            "prefill_lens": [2048, 8192],
            "prefill_tokens": 16384,
            "tail": (32, 8, 1024),
            "compile_batches": [1, 16],
        }
    s.gen_cfg.update(
        decode=decode_config(max(s.batch_sizes), s.prompt_len, s.new_tokens, None), prompt_len=s.prompt_len
    )
    s.gen_cfg["new_tokens"] = s.new_tokens
    s.rl["lr"] = 1e-6
    return s


def new_report(a: argparse.Namespace, s: SimpleNamespace, bandwidth: float, peak: float | None) -> dict:
    """The report before any section ran (each says "not run" until it does)."""
    return {
        "benchmark": "single-device generator decode vs roofline, training MFU, weight sync, GRPO step phases, "
        "decode vs vLLM",
        "dry_run": a.dry_run,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "config": {
            "prompt_len": s.prompt_len,
            "new_tokens": s.new_tokens,
            "dtype": str(s.dtype),
            "generator_compile": "off (--eager)" if a.eager else "default (on for CUDA)",
            "attention_context": s.attention_context,
            "train_batch_seq": list(s.train_shape),
            "budget_s": a.budget_s,
        },
        "models": {},
        "generator": "not run",
        "moe": "not run",
        "rl_step": "not run",
        "vllm": "not run",
    }


def free_device_memory(cuda: bool) -> None:
    gc.collect()  # the workers need the GPU memory this process still holds or caches
    if cuda:
        torch.cuda.empty_cache()


def model_sections(report: dict, measure, names: list[str], models: dict, left, a, cuda: bool, save) -> None:
    """The MoE model's entry, then the models after the first, each while `--model-min-s` is left."""
    moe_name, moe_args = ("debug-moe", get_model_args("debug-moe")) if a.dry_run else MOE_MODEL
    for name in ["moe", *names]:
        if left() < a.model_min_s:
            entry = f"skipped: {left():.0f} s left of the {a.budget_s:.0f} s budget"
        else:
            entry = {"model": moe_name, **measure(moe_name, moe_args)} if name == "moe" else measure(name, models[name])
        if name == "moe":
            report["moe"] = entry
        else:
            report["models"][name] = entry
        save()
        free_device_memory(cuda)


def worker_sections(report: dict, measure, s: SimpleNamespace, left, a, cuda: bool, save) -> None:
    """The MoE model and the other models, then the RL step and vLLM on one HF folder."""
    workdir = tempfile.mkdtemp(prefix="bench_gpu_")
    try:
        free_device_memory(cuda)
        shape = get_model_args(s.rl_flavor)
        try:
            model_dir, jsonl = make_rl_assets(workdir, shape, s.rl["batch_size"] * s.rl["steps"] + 1)
        except Exception as e:  # e.g. no `tokenizers`: the sections below say so, the rest stands
            report["rl_step"] = f"failed: writing the model folder: {type(e).__name__}: {e}"
            report["vllm"] = "not installed" if importlib.util.find_spec("vllm") is None else report["rl_step"]
            model_dir = None
        model_sections(report, measure, list(s.models)[1:], s.models, left, a, cuda, save)
        if model_dir:
            report["rl_step"] = rl_step_section(s.rl, s.rl_flavor, model_dir, jsonl, workdir, left, cuda, a)
            save()
            titanrl_rows = report["models"].get(s.rl_flavor, {}).get("decode", [])
            report["vllm"] = vllm_section(
                model_dir, s.rl_flavor, shape, titanrl_rows, s.prompt_len, s.new_tokens, workdir, left, cuda, a
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def first_model_sections(report: dict, measure, s: SimpleNamespace, device, left, a, save) -> None:
    """The first model's entry and the generator sections on it (a cold start compiles the decode
    step for every batch bucket: minutes on a GPU; a second call with TORCHINDUCTOR_CACHE_DIR set
    to the first's folder runs warm)."""
    compile = False if a.eager else None  # None: the generator's default (compiled on CUDA)
    first_name = next(iter(s.models))
    report["models"][first_name] = measure(first_name, s.models[first_name])
    save()
    report["generator"] = generator_sections(
        first_name, s.models[first_name], device, s.dtype, s.gen_cfg, compile, left, a
    )
    if "warm_compile" in report["generator"]:
        decode = report["models"][first_name]["decode"]
        cold = [r["compile_s"] for r in decode if r["batch"] in s.gen_cfg["compile_batches"]]
        report["generator"]["warm_compile"]["cold_compile_s_in_this_process"] = sum(cold)
    save()


def main() -> None:
    a = parse_args()
    if a.worker:
        worker_main(a.worker, a.worker_config)
        return
    signal.signal(signal.SIGTERM, on_sigterm)
    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    s = run_sizes(a)
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None) if cuda else None
    start = time.perf_counter()

    def left() -> float:
        return a.budget_s - (time.perf_counter() - start)

    bandwidth = copy_bandwidth(device, s.bw_bytes)
    print(f"device {name}: copy bandwidth {bandwidth / 1e9:,.1f} GB/s", flush=True)
    env = environment(device)  # taken now: the workers import the code as it is at the start
    # bench_gpu.sh passes the command it was given (it adds --budget-s); else this module's own.
    command = os.environ.get("BENCH_GPU_COMMAND") or command_line()
    report = new_report(a, s, bandwidth, peak)

    def save() -> None:  # after each section: a run cut short keeps what it measured
        write_json(a.out, {**report, "wall_s": time.perf_counter() - start}, command=command, env=env)

    measure = functools.partial(
        model_entry,
        device=device,
        dtype=s.dtype,
        batch_sizes=s.batch_sizes,
        prompt_len=s.prompt_len,
        new_tokens=s.new_tokens,
        bandwidth=bandwidth,
        compile=False if a.eager else None,
        attention=(s.batch_sizes[:1] if a.dry_run else s.batch_sizes, s.attention_context, not a.dry_run),
        train=(s.train_shape, peak, s.reps),
    )
    first_model_sections(report, measure, s, device, left, a, save)
    worker_sections(report, measure, s, left, a, cuda, save)
    report["wall_s"] = time.perf_counter() - start
    write_json(a.out, report, command=command, env=env)
    print(f"wrote {a.out} in {report['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()

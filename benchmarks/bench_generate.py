"""Generation throughput: titanrl's paged generator vs Hugging Face `transformers.generate`.

Both load the same random weights from one safetensors folder and decode greedily the same
number of tokens for the same prompts (EOS disabled), alternating runs, several repetitions.

- `overhead`: a negligible model (1 layer, width 32) on one thread: milliseconds per decode step
  ((time for T tokens - time for 1) / (T - 1)) at batch 1 / 64 / 256: framework cost per step.
- `batch`: the bench model (debug shape) with GRPO groups (G samples per prompt; HF gets each
  prompt G times): titanrl eager and compiled vs HF, tokens/s and ratios.
- `groups`: prompt sharing (n=G) vs G independent copies with the prefix cache on / off.

titanrl runs with the default `attention_impl = "auto"`: eagerly the gathered-pages attention,
compiled FlexAttention in the decode step. (JSONs from before that change have a
`titanrl_compiled_inplace` column: the compiled in-place decode attention, since removed.)

    python -m benchmarks.bench_generate --out benchmarks/bench_generate.json
    python -m benchmarks.bench_generate --dtype bfloat16 --sections batch --out benchmarks/bench_generate_bf16.json

`--dtype` sets both sides' weights and activations (the exported weights are float32 and are
cast on load); bfloat16 is what RL runs use on GPUs, and this CPU has avx512_bf16 instructions.

Needs `transformers` (the dev extra).
"""

import argparse
import atexit
import functools
import json
import shutil
import statistics
import tempfile

import torch

from benchmarks.harness import decode_seconds, timed_call, timeit_each, write_json
from benchmarks.shapes import NEGLIGIBLE, TINY, debug_shape
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer
from titanrl.models.hf import export_hf, read_hf_config

MODELS = {"debug": debug_shape(), "negligible": NEGLIGIBLE, "tiny": TINY}
DOC_TABLES = [
    ("Milliseconds per decode step, negligible model, 1 thread (framework overhead)", ["overhead", "rows"], None),
    ("GRPO-shaped batches: seconds, tokens/s and speed-up over HF", ["batch"], None),
    ("Prompt sharing (n = G) vs G copies", ["groups"], None),
]


def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g).tolist()


def titanrl_runner(
    folder: str,
    prompts,
    n: int = 1,
    prefix_caching: bool = True,
    compile: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """`run(new_tokens) -> GenerationStats`, greedy, every run with a cold prefix cache (measures
    sharing within a call); warmed up (and the decode step compiled for this batch) here."""
    config = GeneratorConfig(
        block_size=16,
        num_blocks=8192,
        max_num_seqs=1024,
        enable_prefix_caching=prefix_caching,
        compile=compile,
    )
    gen = Generator(read_hf_config(folder), config, torch.device("cpu"), dtype=dtype)
    gen.load_hf(folder)

    def run(new_tokens: int):
        gen.allocator.reset_prefix_cache()
        completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0, n=n))
        assert all(len(c.token_ids) == new_tokens for c in completions)
        return stats

    run(8)
    run(8)
    return run


def hf_runner(folder: str, prompts, dtype: torch.dtype = torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    input_ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def run(new_tokens: int):
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.shape[1] == input_ids.shape[1] + new_tokens

    run(8)
    return run


def _export(name: str) -> tuple[str, dict]:
    torch.manual_seed(0)
    model_args = MODELS[name]
    model = Transformer(model_args)
    model.init_weights()
    folder = tempfile.mkdtemp(prefix="bench_generate_")
    atexit.register(shutil.rmtree, folder, True)
    export_hf(model, folder)
    info = {
        "name": name,
        "dim": model_args.dim,
        "n_layers": model_args.n_layers,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    return folder, info


def bench_overhead(batch_sizes: list[int], new_tokens: int, reps: int, dtype: torch.dtype = torch.float32) -> dict:
    """Milliseconds per decode step of the negligible model on one thread (prefill taken out)."""
    folder, info = _export("negligible")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    for b in batch_sizes:
        prompts = _prompts(b, 16)
        runners = {
            "titanrl": titanrl_runner(folder, prompts, dtype=dtype),
            "titanrl_compiled": titanrl_runner(folder, prompts, compile=True, dtype=dtype),
            "hf": hf_runner(folder, prompts, dtype),
        }
        per_step = {k: [] for k in runners}
        for _ in range(reps):  # the runners alternate within every repetition
            for key, run in runners.items():
                per_step[key].append(decode_seconds(run, new_tokens) / (new_tokens - 1))
        row = {"batch": b, **{f"{k}_ms_per_step": 1e3 * statistics.median(v) for k, v in per_step.items()}}
        row["titanrl_vs_hf"] = row["titanrl_ms_per_step"] / row["hf_ms_per_step"]
        row["titanrl_compiled_vs_hf"] = row["titanrl_compiled_ms_per_step"] / row["hf_ms_per_step"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch.set_num_threads(threads)
    return {"model": info, "threads": 1, "new_tokens": new_tokens, "prompt_len": 16, "rows": rows}


def bench_batches(
    folder: str,
    batch_sizes: list[int],
    group_size: int,
    prompt_len: int,
    new_tokens: int,
    reps: int,
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """GRPO-shaped batches: batch / G prompts with G samples each (HF decodes each prompt G times)."""
    rows = []
    for batch in batch_sizes:
        G = group_size if batch % group_size == 0 else 1
        prompts = _prompts(batch // G, prompt_len)
        runners = {
            "titanrl": titanrl_runner(folder, prompts, n=G, dtype=dtype),
            "titanrl_compiled": titanrl_runner(folder, prompts, n=G, compile=True, dtype=dtype),
            "hf": hf_runner(folder, [p for p in prompts for _ in range(G)], dtype),
        }
        calls = {k: functools.partial(run, new_tokens) for k, run in runners.items()}
        times = timeit_each(calls, warmup=0, repeat=reps)  # the runners warmed up as they were built
        row = {"batch": batch, "group_size": G, **{f"{k}_s": t.median for k, t in times.items()}}
        for key in runners:
            row[f"{key}_tok_s"] = batch * new_tokens / row[f"{key}_s"]
        row["speedup_vs_hf"] = row["hf_s"] / row["titanrl_s"]
        row["speedup_compiled_vs_hf"] = row["hf_s"] / row["titanrl_compiled_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_groups(
    folder: str, group_size: int, prompt_len: int, new_tokens: int, reps: int, dtype: torch.dtype = torch.float32
) -> dict:
    """G samples of each prompt: shared prompt blocks (n=G) vs G independent copies."""
    G, n_prompts = group_size, 8
    prompts = _prompts(n_prompts, prompt_len, seed=1)
    copies = [p for p in prompts for _ in range(G)]
    variants = {
        "group_shared": titanrl_runner(folder, prompts, n=G, dtype=dtype),
        "copies_prefix_cache_on": titanrl_runner(folder, copies, prefix_caching=True, dtype=dtype),
        "copies_prefix_cache_off": titanrl_runner(folder, copies, prefix_caching=False, dtype=dtype),
    }
    groups = {}
    for name, run in variants.items():
        times, stats = [], None
        for _ in range(reps):
            seconds, stats = timed_call(functools.partial(run, new_tokens))
            times.append(seconds)
        groups[name] = {
            "seconds": statistics.median(times),
            "prefill_tokens": stats.prefill_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        }
    groups["speedup_shared_vs_no_cache"] = (
        groups["copies_prefix_cache_off"]["seconds"] / groups["group_shared"]["seconds"]
    )
    return {"group_size": G, "prompts": n_prompts, "prompt_len": prompt_len, **groups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_generate.json")
    parser.add_argument("--batch_sizes", default="1,64,256")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--overhead_new_tokens", type=int, default=128)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="debug", choices=sorted(MODELS))
    parser.add_argument("--sections", default="overhead,batch,groups")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both sides' weights and activations (bfloat16: fast on CPUs with avx512_bf16 / AMX)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    sections = args.sections.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    folder, info = _export(args.model)
    # Every option's value, defaults included (the command records only what was typed).
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "model": info, "dtype": args.dtype}
    if "overhead" in sections:
        report["overhead"] = bench_overhead(batch_sizes, args.overhead_new_tokens, args.reps, dtype)
    if "batch" in sections:
        report["batch"] = bench_batches(
            folder, batch_sizes, args.group_size, args.prompt_len, args.new_tokens, args.reps, dtype
        )
    if "groups" in sections:
        report["groups"] = bench_groups(folder, args.group_size, 4 * args.prompt_len, args.new_tokens, args.reps, dtype)
        print(json.dumps(report["groups"]), flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()

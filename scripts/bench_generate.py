"""Generation throughput: titanrl's paged generator vs Hugging Face `transformers.generate`.

Both load the same random weights from one safetensors folder and decode greedily the same
number of tokens for the same prompts (EOS disabled), alternating runs, several repetitions.
Also compares GRPO-style groups (G samples per prompt) with prompt sharing on and off.

    python scripts/bench_generate.py --out bench_generate.json

Writes JSON with median seconds, tokens/s and titanrl/HF ratios. Needs `transformers` (the dev extra).
"""

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch

from titanrl.config.rl_sections import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.hf import export_hf, read_hf_config

MODELS = {
    # The debug flavor's shape (3.2M params): matmul-bound on 2 CPU cores.
    "debug": TransformerModelArgs(
        family="qwen3", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=768, vocab_size=264,
        qk_norm=True, tie_word_embeddings=True, max_seq_len=512,
    ),
    # A tiny model (0.1M params): per-step framework overhead dominates.
    "tiny": TransformerModelArgs(
        family="qwen3", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=264,
        qk_norm=True, tie_word_embeddings=True, max_seq_len=512,
    ),
}


def _prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g).tolist()


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_titanrl(folder: str, prompts, new_tokens: int, n: int = 1, prefix_caching: bool = True, compile: bool = False):
    config = GeneratorConfig(block_size=16, num_blocks=4096, max_num_seqs=512, enable_prefix_caching=prefix_caching,
                             compile=compile)
    gen = Generator(read_hf_config(folder), config, torch.device("cpu"))
    gen.load_hf(folder)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, n=n)
    # Warm-up on the same batch (compiles the decode step for its bucket when compile=True).
    gen.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0, n=n))
    results = {}

    def run():
        gen.allocator.reset_prefix_cache()  # every run starts cold: measures sharing within a call
        completions, stats = gen.generate(prompts, params)
        assert all(len(c.token_ids) == new_tokens for c in completions)
        results["stats"] = stats

    return run, results


def bench_hf(folder: str, prompts, new_tokens: int):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    input_ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def run():
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        assert out.shape[1] == input_ids.shape[1] + new_tokens

    run()  # warm-up
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_generate.json")
    parser.add_argument("--batch_sizes", default="1,16,64")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="debug", choices=sorted(MODELS))
    args = parser.parse_args()
    torch.manual_seed(0)
    model_args = MODELS[args.model]
    model = Transformer(model_args)
    model.init_weights()
    folder = tempfile.mkdtemp(prefix="bench_generate_")
    export_hf(model, folder)

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": "python scripts/bench_generate.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "model": {"name": args.model, "dim": model_args.dim, "n_layers": model_args.n_layers,
                  "params_M": sum(p.numel() for p in model.parameters()) / 1e6},
        "batch": [],
    }
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = _prompts(batch, args.prompt_len)
        ours, _ = bench_titanrl(folder, prompts, args.new_tokens)
        ours_compiled, _ = bench_titanrl(folder, prompts, args.new_tokens, compile=True)
        hf = bench_hf(folder, prompts, args.new_tokens)
        t_ours, t_compiled, t_hf = [], [], []
        for _ in range(args.reps):
            t_ours.append(_time(ours))
            t_compiled.append(_time(ours_compiled))
            t_hf.append(_time(hf))
        tokens = batch * args.new_tokens
        row = {
            "batch": batch,
            "titanrl_s": statistics.median(t_ours),
            "titanrl_compiled_s": statistics.median(t_compiled),
            "hf_s": statistics.median(t_hf),
        }
        for key in ("titanrl", "titanrl_compiled", "hf"):
            row[f"{key}_tok_s"] = tokens / row[f"{key}_s"]
        row["speedup_vs_hf"] = row["hf_s"] / row["titanrl_s"]
        row["speedup_compiled_vs_hf"] = row["hf_s"] / row["titanrl_compiled_s"]
        report["batch"].append(row)
        print(json.dumps(row), flush=True)

    # GRPO groups: G samples of each prompt; shared prompt blocks (n=G) vs G independent copies.
    G, n_prompts = args.group_size, 8
    prompts = _prompts(n_prompts, 4 * args.prompt_len, seed=1)
    copies = [p for p in prompts for _ in range(G)]
    variants = {
        "group_shared": bench_titanrl(folder, prompts, args.new_tokens, n=G),
        "copies_prefix_cache_on": bench_titanrl(folder, copies, args.new_tokens, prefix_caching=True),
        "copies_prefix_cache_off": bench_titanrl(folder, copies, args.new_tokens, prefix_caching=False),
    }
    groups = {}
    for name, (run, results) in variants.items():
        times = [_time(run) for _ in range(args.reps)]
        groups[name] = {"seconds": statistics.median(times), "prefill_tokens": results["stats"].prefill_tokens,
                        "prefix_cache_hit_tokens": results["stats"].prefix_cache_hit_tokens}
    groups["speedup_shared_vs_no_cache"] = groups["copies_prefix_cache_off"]["seconds"] / groups["group_shared"]["seconds"]
    report["groups"] = {"group_size": G, "prompts": n_prompts, "prompt_len": 4 * args.prompt_len, **groups}
    print(json.dumps(report["groups"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

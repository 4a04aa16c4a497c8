"""Decoding while a long prompt is prefilled: chunked prefill against one-forward prefill.

    python -m benchmarks.bench_chunked_prefill --out benchmarks/bench_chunked_prefill.json

Same model (debug shape, max_seq_len raised to fit the long prompt, random weights), same
prompts in one `generate` call: `--short` short prompts that decode `--new-tokens` tokens each,
then one `--long-len`-token prompt (also decoding). generator.max_num_batched_tokens =
`--chunk`, one decode step per scheduler pass (serving-engine style), greedy:
  chunked    enable_chunked_prefill = true: the long prompt goes in chunks of `--chunk` tokens,
             the short samples decode one step after every chunk
  unchunked  enable_chunked_prefill = false: the long prompt is prefilled alone in one forward,
             and no sample decodes meanwhile (the stall serving engines avoid)
Per run, from a clock read after every scheduler pass: the decode tokens/s of the short samples
while the long prompt is prefilled (from the call's start until its prefill is done), the
longest gap between two passes that decoded (the worst inter-token latency a short sample
sees), the long prompt's time to its first token, and the whole call's decode tokens/s.
Median over `--repeats` interleaved runs; ratios chunked / unchunked.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from benchmarks.harness import write_json
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

MODES = {"chunked": True, "unchunked": False}
DOC_TABLES = [("Median per mode", ["summary"], None), ("Ratios (chunked / unchunked)", ["ratios"], None)]


def one_run(gen: Generator, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """One generate call, timed after every scheduler pass through `pause_when`."""
    total_prompt = sum(len(p) for p in prompts)
    passes: list[tuple[float, int, int]] = []  # (seconds since start, prefill tokens, decode tokens)
    start = time.perf_counter()

    def pause_when(finished, stats) -> bool:
        passes.append((time.perf_counter() - start, stats.prefill_tokens, stats.decode_tokens))
        return False

    _, stats = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0), pause_when=pause_when)
    seconds = time.perf_counter() - start
    prefilled_at, decoded_by_then = next((t, d) for t, p, d in passes if p == total_prompt)
    decode_times = [0.0] + [t for (t, _, d), (_, _, d0) in zip(passes[1:], passes) if d > d0]
    return {
        "seconds": seconds,
        "long_prompt_prefilled_s": prefilled_at,
        "decode_tokens_per_s_during_long_prefill": decoded_by_then / prefilled_at,
        "max_decode_gap_s": max(b - a for a, b in zip(decode_times, decode_times[1:])),
        "decode_tokens_per_s": stats.decode_tokens / seconds,
        "prefill_chunks": stats.prefill_chunks,
        "scheduler_passes": stats.scheduler_passes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    args = dataclasses.replace(get_model_args("debug"), max_seq_len=a.long_len + a.new_tokens + 16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in [a.short_len] * a.short]
    prompts.append(torch.randint(0, args.vocab_size, (a.long_len,), generator=g).tolist())
    gens = {}
    for mode, chunked in MODES.items():
        config = GeneratorConfig(
            block_size=16,
            num_blocks=(a.long_len + (a.short + 1) * (a.short_len + a.new_tokens)) // 16 + 64,
            max_num_batched_tokens=a.chunk,
            enable_chunked_prefill=chunked,
            decode_steps_per_schedule=1,
            enable_prefix_caching=False,
        )
        gens[mode] = Generator(args, config, torch.device("cpu"))
        gens[mode].load_weights(model)
        one_run(gens[mode], prompts, a.new_tokens)  # warm-up
    runs = {mode: [] for mode in MODES}
    for _ in range(a.repeats):
        for mode, gen in gens.items():
            runs[mode].append(one_run(gen, prompts, a.new_tokens))
            print(mode, runs[mode][-1], flush=True)
    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    c, u = summary["chunked"], summary["unchunked"]
    # Unchunked, nothing decodes while the long prompt is prefilled: no ratio (None) then.
    during = "decode_tokens_per_s_during_long_prefill"
    ratios = {
        during: c[during] / u[during] if u[during] > 0 else None,
        "max_decode_gap": c["max_decode_gap_s"] / u["max_decode_gap_s"],
        "long_prompt_prefilled": c["long_prompt_prefilled_s"] / u["long_prompt_prefilled_s"],
        "decode_tokens_per_s": c["decode_tokens_per_s"] / u["decode_tokens_per_s"],
        "seconds": c["seconds"] / u["seconds"],
    }
    config = {**vars(a), "model": "debug flavor, random weights", "max_seq_len": args.max_seq_len}
    results = {"config": config, "summary": summary, "ratios": ratios, "runs": runs}
    print(summary, ratios)
    if a.out:
        write_json(a.out, results, device="cpu")


if __name__ == "__main__":
    main()

"""Start-up cost of the compiled generator: compile seconds of a first run (empty compile cache)
and of a second run in a new process over the cache the first one filled (what a restarted or
resumed job pays: `<dump_folder>/compile_cache`, `titanrl/components/compile_cache.py`).

Each run is a fresh Python process (`--worker`) that builds the bench model's generator (debug
shape, random weights) with `compile = true` on this machine's device and generates greedily for
two batches that fall in two batch buckets (8 and 32 rows): the compiled decode step of each
bucket (FlexAttention inside), the compiled one-step decode of top-logprob requests, and on CUDA
the prefill attention. `compile_s` is `GenerationStats.compile_seconds` summed over the calls
(dynamo tracing plus inductor; a cache hit costs the tracing), `wall_s` the calls' wall time.

    python -m benchmarks.bench_compile --out benchmarks/bench_compile.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.harness import REPO_ROOT, write_json

DOC_TABLES = [("Compile seconds, cold and warm cache", ["runs"], None)]
BATCHES = (6, 20)  # decode buckets 8 and 32
NEW_TOKENS = 24


def worker() -> dict:
    """One process's generations; prints and returns its compile seconds (cache from the env)."""
    from benchmarks.shapes import debug_shape
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import Generator, SamplingParams
    from titanrl.models import Transformer

    args = debug_shape()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    model.init_weights()
    gen = Generator(args, GeneratorConfig(block_size=16, num_blocks=512, compile=True), device)
    gen.load_weights(model)
    g = torch.Generator().manual_seed(0)
    compile_s, start = 0.0, time.perf_counter()
    for batch in BATCHES:
        prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (batch,))]
        for top in (0, 2):  # the multi-step decode loop, then one-step decodes (top logprobs)
            params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, num_top_logprobs=top)
            _, stats = gen.generate(prompts, params)
            compile_s += stats.compile_seconds
    out = {"compile_s": round(compile_s, 2), "wall_s": round(time.perf_counter() - start, 2)}
    print(json.dumps(out), flush=True)
    return out


def run_worker(cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_compile", "--worker"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "bench_compile.json"))
    p.add_argument("--worker", action="store_true", help="one measured process (internal)")
    a = p.parse_args()
    if a.worker:
        worker()
        return
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as cache_dir:
        cold = run_worker(cache_dir)
        warm = run_worker(cache_dir)
    runs = [{"run": "first (empty cache)", **cold}, {"run": "second (warm cache)", **warm}]
    results = {
        "model": "debug shape (3.2M params)",
        "batches": list(BATCHES),
        "new_tokens": NEW_TOKENS,
        "runs": runs,
        "warm_over_cold_compile": round(warm["compile_s"] / max(cold["compile_s"], 1e-9), 3),
    }
    print(json.dumps(results), flush=True)
    write_json(a.out, results)


if __name__ == "__main__":
    main()

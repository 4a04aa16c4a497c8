"""Peak memory of one forward + backward of the token-logprob loss at a real vocabulary:
full [B, T, vocab] logits (`token_logprobs(model(x))`) vs chunked (`model.logprobs`), each in a
fresh process (peak RSS on CPU, peak allocated on CUDA), beside the floor of weights + grads.

    python -m benchmarks.bench_logprob_memory --out benchmarks/bench_logprob_memory.json
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from benchmarks.harness import REPO_ROOT, timed_call, write_json
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.logprobs import token_logprobs

DOC_TABLES = [
    ("Peak memory and step time, full logits vs chunked", ["full|chunked"], None),
    ("Chunked over full", ["*_ratio_*"], None),
]


def model_args(a) -> TransformerModelArgs:
    return TransformerModelArgs(
        family="qwen2",
        dim=a.dim,
        n_layers=a.layers,
        n_heads=14,
        n_kv_heads=2,
        hidden_dim=4864,
        vocab_size=a.vocab,
        tie_word_embeddings=True,
        max_seq_len=a.seq_len + 1,
    )


def run_one(a) -> dict:
    """One measurement in this process."""
    torch.manual_seed(0)
    model = Transformer(model_args(a))
    model.init_weights()
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1))
    base_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def step() -> None:
        if a.mode == "full":
            logprobs = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])
        else:
            logprobs, _ = model.logprobs(tokens[:, :-1], tokens[:, 1:], a.chunk, with_entropy=True)
        (-logprobs.mean()).backward()

    seconds, _ = timed_call(step)  # one step: its peak memory is the measurement
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    params = sum(p.numel() for p in model.parameters())
    return {
        "mode": a.mode,
        "peak_rss_gb": peak_gb,
        "rss_before_step_gb": base_gb,
        "step_seconds": seconds,
        "params": params,
        "weights_and_grads_gb": 2 * 4 * params / 2**30,
        "full_logits_gb": 4 * a.batch * a.seq_len * a.vocab / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dim", type=int, default=896)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--mode", choices=["full", "chunked"], default=None, help="internal: one measurement")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.mode:
        print(json.dumps(run_one(a)))
        return
    results = {}
    for mode in ("full", "chunked"):
        cmd = [sys.executable, "-m", "benchmarks.bench_logprob_memory", "--mode", mode] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("mode", "out")
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}, cwd=REPO_ROOT)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    report = {
        "config": {k: v for k, v in vars(a).items() if k not in ("mode", "out")},
        **results,
        "peak_ratio_chunked_over_full": results["chunked"]["peak_rss_gb"] / results["full"]["peak_rss_gb"],
        "step_time_ratio_chunked_over_full": results["chunked"]["step_seconds"] / results["full"]["step_seconds"],
    }
    print(json.dumps(report, indent=2))
    if a.out:
        write_json(a.out, report, device="cpu")


if __name__ == "__main__":
    main()

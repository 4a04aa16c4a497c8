"""Generator memory per sequence and decode tokens/s versus context length: the Qwen3.5-style
hybrid debug model (three gated DeltaNet layers, one full-attention layer) against the dense
debug model.

    python -m benchmarks.bench_hybrid_memory --out benchmarks/bench_hybrid_memory.json
    python -m benchmarks.bench_hybrid_memory --shape qwen3.5 --device cuda  # scripts/bench_gpu.sh --hybrid

Both flavors at the debug width with random weights, max_seq_len raised to fit. Per context
length: `--batch` prompts of that length decode `--new-tokens` greedy tokens in one `generate`
call. Read from the generator at the last scheduler pass (all sequences still hold their
memory): the KV bytes the pool's held blocks take, and the state-slot bytes the held slots take
(hybrid only: per linear layer a conv state and a float32 [heads, key dim, value dim] matrix),
both per sequence. Decode tokens/s: from the pass that finished the prefill to the call's end,
median over `--repeats`, the two models' calls interleaved. The dense model's KV grows with the
context in all four layers; the hybrid's in one of four, and its state does not grow.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from benchmarks.harness import write_json
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.args import TransformerModelArgs
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

FLAVORS = ("debug", "debug-qwen3.5")
# `--shape qwen3.5`: two layers of Qwen3-Next / Qwen3.5 shapes (hidden 2048; full attention 16
# heads of 256 over 2 KV heads, partial rotary 0.25; gated DeltaNet 16 key / 32 value heads of 128;
# a dense 6144 MLP), as a linear + a full-attention layer, against two full-attention layers.
_QWEN35_LAYERS = TransformerModelArgs(
    family="qwen3_5",
    dim=2048,
    n_layers=2,
    n_heads=16,
    n_kv_heads=2,
    head_dim=256,
    hidden_dim=6144,
    vocab_size=151936,
    qk_norm=True,
    rope_theta=1e7,
    layer_types=["linear_attention", "full_attention"],
    attn_output_gate=True,
    partial_rotary_factor=0.25,
)
SHAPES = {
    "debug": {name: get_model_args(name) for name in FLAVORS},
    "qwen3.5": {
        "qwen3.5-2-layers-dense": dataclasses.replace(
            _QWEN35_LAYERS, family="qwen3", layer_types=[], attn_output_gate=False, partial_rotary_factor=1.0
        ),
        "qwen3.5-2-layers-hybrid": _QWEN35_LAYERS,
    },
}
DOC_TABLES = [("Per flavor and context length", ["rows"], None)]


def one_run(gen: Generator, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict[str, int]]:
    """(decode tokens/s of one generate call, from the pass that finished the prefill to the end;
    the bytes its sequences held at its last scheduler pass)."""
    held: dict[str, int] = {}
    prefilled_at: list[float] = []
    total_prompt = sum(map(len, prompts))

    def pause_when(finished, stats) -> bool:
        assert gen.allocator is not None
        if stats.prefill_tokens == total_prompt and not prefilled_at:
            prefilled_at.append(time.perf_counter())
        held["kv_blocks"] = gen.num_blocks - gen.allocator.num_free
        slots = gen.state_slots
        held["state_slots"] = (gen.config.max_num_seqs - slots.num_free) if slots is not None else 0
        return False

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    _, stats = gen.generate(prompts, params, pause_when=pause_when)
    return stats.decode_tokens / (time.perf_counter() - prefilled_at[0]), held


def build(base: TransformerModelArgs, length: int, a: argparse.Namespace) -> Generator:
    """A generator holding `base` (random weights) for `--batch` prompts of `length` tokens."""
    args = dataclasses.replace(base, max_seq_len=length + a.new_tokens + 16)
    device = torch.device(a.device)
    torch.manual_seed(0)
    with device:
        model = Transformer(args)
    model.init_weights()
    config = GeneratorConfig(
        block_size=16,
        num_blocks=a.batch * ((length + a.new_tokens) // 16 + 2) + 8,
        max_num_seqs=a.batch,
        max_num_batched_tokens=max(2048, a.batch * length),
        decode_steps_per_schedule=1,
        enable_prefix_caching=False,
    )
    gen = Generator(args, config, device)
    gen.load_weights(model)
    return gen


def measure_length(length: int, a: argparse.Namespace) -> list[dict]:
    """One row per model at `length`; the models' runs interleaved (a slow spell hits both)."""
    gens = {name: build(args, length, a) for name, args in SHAPES[a.shape].items()}
    g = torch.Generator().manual_seed(1)
    vocab = min(gen.args.vocab_size for gen in gens.values())
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(a.batch)]
    for gen in gens.values():
        one_run(gen, prompts, 2)  # warm-up
    runs: dict[str, list] = {name: [] for name in gens}
    for _ in range(a.repeats):
        for name, gen in gens.items():
            runs[name].append(one_run(gen, prompts, a.new_tokens))
    rows = []
    for name, gen in gens.items():
        held = runs[name][-1][1]
        slot_bytes = gen.state_slots.nbytes // (a.batch + 1) if gen.state_slots is not None else 0
        rows.append(
            {
                "flavor": name,
                "context": length + a.new_tokens,
                "kv_bytes_per_seq": held["kv_blocks"] * gen._bytes_per_block() // a.batch,
                "state_bytes_per_seq": held["state_slots"] * slot_bytes // a.batch,
                "decode_tokens_per_s": statistics.median(r[0] for r in runs[name]),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shape", choices=sorted(SHAPES), default="debug")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for length in a.lengths:
        rows += measure_length(length, a)
        print(*rows[-len(SHAPES[a.shape]) :], sep="\n", flush=True)
    results = {"config": {**vars(a), "models": f"{', '.join(SHAPES[a.shape])}, random weights"}, "rows": rows}
    if a.out:
        write_json(a.out, results, device=a.device)


if __name__ == "__main__":
    main()

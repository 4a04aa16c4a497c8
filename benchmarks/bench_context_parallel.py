"""Peak memory per rank against sequence length under context parallelism (cp = 1, 2, 4) and the
longest sequence that trains within a fixed memory budget.

    python -m benchmarks.bench_context_parallel        # writes benchmarks/bench_context_parallel.json

Each cp degree runs under torchrun with gloo ranks on the CPU (cp ranks, which are also the FSDP2
group: TorchTitan's layout). One training step of the debug model (dim 256, 4 layers, GQA) on one
sequence of T tokens: `forward_logprobs` (the trainer's path: sequence shards, all-gathered keys
and values, chunked vocabulary logprobs), a token-mean loss, backward; full activation
checkpointing. Memory is measured by torch's `MemTracker` (`torch.distributed._tools`), which
follows every tensor's storage through a dispatch mode, so it works on the CPU where the
allocator keeps no statistics; the number is the step's peak of live bytes on the rank
(parameters, gradients, activations, temporaries), the largest over the cp ranks. The budget is
what cp = 1 peaks at for BASE_T tokens; the longest length within it is found by bisection on
multiples of 256 tokens, every candidate length measured.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks.harness import environment, write_json

DOC_TABLES = [
    ("Peak bytes per rank against sequence length, longest length within the cp = 1 budget", ["rows"], None),
]

BASE_T = 2048
GRID = [1024, 2048, 4096]
STEP = 256


def measure(model, T: int) -> int:
    """This step's peak bytes on this rank, the largest over ranks."""
    from tensordict import TensorDict
    from torch.distributed._tools.mem_tracker import MemTracker

    from titanrl.data.batch_forward import forward_logprobs

    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(1, 250, (1, T + 1), generator=g)
    batch = TensorDict({"tokens": tokens, "loss_mask": torch.ones(1, T), "length": torch.tensor([T + 1])}, [1])
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logprobs, _ = forward_logprobs(model, batch, False, 256)
        (-logprobs.sum() / T).backward()
    model.zero_grad(set_to_none=True)
    peak = torch.tensor(float(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def longest_within(model, budget: int, lo: int, hi: int) -> int:
    """The longest multiple of STEP in [lo, hi] whose step peaks within `budget` (lo fits)."""
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        if measure(model, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def worker(budget: int, out: str) -> None:
    from titanrl.components.model_builder import build_model, init_full_state_dict
    from titanrl.config.job_config import JobConfig
    from titanrl.distributed import ParallelDims, init_distributed
    from titanrl.models.flavors import get_model_args

    rank, world = init_distributed()
    config = JobConfig()
    config.activation_checkpoint.mode = "full"
    args = get_model_args("debug")
    args.max_seq_len = 32768
    dims = ParallelDims(1, 1, 1, world, cp=world)
    model = build_model(args, dims, config, torch.device("cpu"), full_state_dict=init_full_state_dict(args, seed=0))
    result = {"cp": world, "peak_bytes": {str(T): measure(model, T) for T in GRID}}
    if budget:
        result["longest_in_budget"] = longest_within(model, budget, BASE_T, BASE_T * world * 5 // 4)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def train_step_speed(flavor: str, seq: int) -> None:
    """scripts/bench_gpu.sh's long-context entry: training tokens/s and peak memory of one
    sequence of `seq` tokens, cp = the torchrun world (bf16 on CUDA, full activation
    checkpointing); rank 0 prints one JSON line. On the CPU (the script's dry run) float32."""
    import time

    from titanrl.components.model_builder import build_model
    from titanrl.config.job_config import JobConfig
    from titanrl.distributed import ParallelDims, init_distributed
    from titanrl.models.flavors import get_model_args

    rank, world = init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = JobConfig()
    config.activation_checkpoint.mode = "full"
    config.training.mixed_precision_param = "bfloat16" if cuda else "float32"
    args = get_model_args(flavor)
    args.max_seq_len = max(args.max_seq_len, seq)
    with torch.device(device):
        model = build_model(args, ParallelDims(1, 1, 1, world, cp=world), config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(1, args.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    from tensordict import TensorDict

    from titanrl.data.batch_forward import forward_logprobs

    batch = TensorDict({"tokens": tokens, "loss_mask": torch.ones(1, seq, device=device)}, [1])
    batch["length"] = torch.tensor([seq + 1], device=device)
    times = []
    for _ in range(3):  # the first: warm-up
        began = time.perf_counter()
        logprobs, _ = forward_logprobs(model, batch, False, 2048)
        (-logprobs.sum() / seq).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if rank == 0:
        row = {"flavor": flavor, "seq": seq, "cp": world, "tokens_per_s": round(seq / min(times[1:]), 1)}
        print(json.dumps({"long_context": {**row, "peak_memory_gib_rank0": peak}}), flush=True)
    dist.destroy_process_group()


def launch(cp: int, budget: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}"]
        cmd += ["-m", "benchmarks.bench_context_parallel", "--worker", "--budget", str(budget), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--train-step", action="store_true", help="scripts/bench_gpu.sh's long-context entry")
    parser.add_argument("--flavor", default="qwen2.5-0.5b")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "bench_context_parallel.json"))
    cli = parser.parse_args()
    if cli.worker:
        return worker(cli.budget, cli.out)
    if cli.train_step:
        return train_step_speed(cli.flavor, cli.seq)
    env = environment("cpu")  # the code the subprocesses import
    one = launch(1, 0)
    budget = one["peak_bytes"][str(BASE_T)]
    rows = [{**one, "longest_in_budget": BASE_T}] + [launch(cp, budget) for cp in (2, 4)]
    for row in rows:
        row["length_ratio"] = row["longest_in_budget"] / BASE_T
        row["peak_ratio_at_4096"] = one["peak_bytes"]["4096"] / row["peak_bytes"]["4096"]
    results = {
        "model": "debug flavor (dim 256, 4 layers, 4 heads / 2 kv heads), full activation checkpointing",
        "memory": "MemTracker peak live bytes per rank (max over cp ranks), one forward + backward",
        "budget_bytes": budget,
        "budget": f"cp = 1 peak at {BASE_T} tokens",
        "rows": rows,
    }
    write_json(cli.out, results, "python -m benchmarks.bench_context_parallel", env=env)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

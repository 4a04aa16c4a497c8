"""Trainer -> generator weight sync time vs model size and dp / tp degrees (gloo on CPU, NCCL on GPU).

    python scripts/bench_weight_sync.py --out benchmarks/bench_weight_sync.json

Launches one torchrun job per world size (1 and 2 ranks); in each, for every layout and model
size, times `Generator.load_weights` (median of --reps) and one trainer step (forward + backward
+ AdamW on 8 x 128 tokens), and reports sync time as a fraction of that step.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

SIZES = {  # name -> (dim, n_layers, hidden_dim)
    "3M": (256, 4, 768),
    "25M": (512, 8, 1536),
}
LAYOUTS = {1: [(1, 1, 1)], 2: [(1, 2, 1), (1, 1, 2)]}  # (dp_replicate, dp_shard, tp)


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(reps: int, out: str) -> None:
    import torch.distributed as dist

    from titanrl.components.model_builder import build_model, init_full_state_dict
    from titanrl.config.job_config import JobConfig
    from titanrl.config.rl_sections import Generator as GeneratorConfig
    from titanrl.distributed import ParallelDims, init_distributed
    from titanrl.generator import Generator
    from titanrl.models import TransformerModelArgs

    rank, world = init_distributed()
    rows = []
    for degrees in LAYOUTS[world]:
        dims = ParallelDims(*degrees, world_size=world)
        for name, (dim, n_layers, hidden) in SIZES.items():
            args = TransformerModelArgs(
                family="qwen3",
                dim=dim,
                n_layers=n_layers,
                n_heads=8,
                n_kv_heads=4,
                hidden_dim=hidden,
                vocab_size=512,
                qk_norm=True,
                max_seq_len=256,
            )
            trainer = build_model(
                args, dims, JobConfig(), torch.device("cpu"), full_state_dict=init_full_state_dict(args, 0)
            )
            gen = Generator(
                args,
                GeneratorConfig(num_blocks=16),
                torch.device("cpu"),
                tp_mesh=dims.world_mesh["tp"] if dims.tp_enabled else None,
            )
            opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
            tokens = torch.randint(0, 512, (8 // dims.dp_size, 129))

            def train_step():
                opt.zero_grad()
                trainer(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
                opt.step()

            gen.load_weights(trainer)  # warm-up
            train_step()
            sync_s = _median_time(lambda: gen.load_weights(trainer), reps)
            step_s = _median_time(train_step, max(2, reps // 2))
            rows.append(
                {
                    "world": world,
                    "dp_replicate": degrees[0],
                    "dp_shard": degrees[1],
                    "tp": degrees[2],
                    "model": name,
                    "params_M": sum(p.numel() for p in gen.model.parameters()) / 1e6,  # DTensor numel is global
                    "sync_s": sync_s,
                    "train_step_s": step_s,
                    "sync_fraction_of_step": sync_s / (sync_s + step_s),
                }
            )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_weight_sync.json")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.reps, args.worker_out)
        return
    rows = []
    for world in LAYOUTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={world}",
                os.path.abspath(__file__),
                "--worker",
                "--worker_out",
                tmp.name,
                "--reps",
                str(args.reps),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
            subprocess.run(cmd, check=True, env=env)
            rows += json.load(open(tmp.name))
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, gloo",
        "command": f"python scripts/bench_weight_sync.py --reps {args.reps}",
        "rows": rows,
    }
    for r in rows:
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

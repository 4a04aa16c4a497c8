"""Trainer -> generator weight sync time vs model size and dp / tp degrees (gloo on CPU, NCCL on GPU).

    python -m benchmarks.bench_weight_sync --out benchmarks/bench_weight_sync.json

Launches one torchrun job per world size (1 and 2 ranks); in each, for every layout and model
size, times `Generator.load_weights` (median of --reps after one warm-up) and one trainer step
(forward + backward + AdamW on 8 x 128 tokens; median of max(2, reps / 2)), and reports sync
time as a fraction of sync + step.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.harness import REPO_ROOT, timeit, write_json

SIZES = {  # name -> (dim, n_layers, hidden_dim)
    "3M": (256, 4, 768),
    "25M": (512, 8, 1536),
}
LAYOUTS = {1: [(1, 1, 1)], 2: [(1, 2, 1), (1, 1, 2)]}  # (dp_replicate, dp_shard, tp)
DOC_TABLES = [("Sync seconds against a training step", ["rows"], None)]


def _train_step(trainer: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    opt.zero_grad()
    trainer(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
    opt.step()


def worker(reps: int, out: str) -> None:
    import torch.distributed as dist

    from titanrl.components.model_builder import build_model, init_full_state_dict
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.config.job_config import JobConfig
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
            step = functools.partial(_train_step, trainer, opt, tokens)
            step()  # warm-up: the first step allocates gradients and AdamW's state
            sync_s = timeit(functools.partial(gen.load_weights, trainer), warmup=1, repeat=reps).median
            step_s = timeit(step, warmup=0, repeat=max(2, reps // 2)).median
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
                "-m",
                "benchmarks.bench_weight_sync",
                "--worker",
                "--worker_out",
                tmp.name,
                "--reps",
                str(args.reps),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
            subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT)
            rows += json.load(open(tmp.name))
    for r in rows:
        print(json.dumps(r))
    write_json(args.out, {"backend": "gloo", "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()

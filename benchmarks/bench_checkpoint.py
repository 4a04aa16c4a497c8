"""What checkpoint checksums cost: a save with and without its manifest (sync and async), verification, hashes.

    python -m benchmarks.bench_checkpoint --out benchmarks/bench_checkpoint.json

One process, the `debug-large` model with AdamW state (fp32: model and two moments), saved by
`CheckpointManager` into a folder on local disk. "without checksums" is the same save with the
manifest step (`CheckpointManager._seal`: each rank reads back and CRC-32s what it wrote, rank 0
writes checksums.json) replaced by nothing; the rows interleave the two (`timeit_each`). For async
saves, `blocking_s` is what training waits for (`save` returning), `total_s` the time until the
checkpoint is published (`wait`). `verify_s` is `verify_checkpoint` on the saved folder; the hash
rows time the stdlib candidates over its largest shard, from the page cache.
"""

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import zlib
from unittest import mock

import torch

from benchmarks.harness import timeit, timeit_each, write_json
from titanrl.components.checkpoint import CheckpointManager, verify_checkpoint
from titanrl.models import Transformer, get_model_args

DOC_TABLES = [
    ("Save seconds with and without checksums", ["saves"], None),
    ("Verification and hash throughput", ["verify"], None),
    ("Hash throughput, MB/s", ["hashes"], None),
]


def _parts() -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = Transformer(get_model_args("debug-large"))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 256, (1, 16))).float().mean().backward()
    optimizer.step()
    return {"model": model}, {"model": optimizer}


def _saver(folder: str, async_mode: str, parts: tuple[dict, dict], checksums: bool):
    """A function that saves the next step into its own folder (keeping none of the earlier) and
    returns (blocking seconds, total seconds)."""
    manager = CheckpointManager(folder, keep_latest_k=1, async_mode=async_mode)
    step = [0]

    def save() -> tuple[float, float]:
        step[0] += 1
        began = time.perf_counter()
        with mock.patch.object(CheckpointManager, "_seal", CheckpointManager._seal if checksums else _no_seal):
            manager.save(step[0], *parts, {"step": step[0]})
            blocking = time.perf_counter() - began
            manager.wait()
        return blocking, time.perf_counter() - began

    return save


def _no_seal(self, tmp, group) -> None:
    pass


def _hash_rate(path: str, name: str, repeat: int) -> float:
    data = open(path, "rb").read()

    def run() -> None:
        if name in ("crc32", "adler32"):
            getattr(zlib, name)(data)
        else:
            hashlib.new(name, data).digest()

    return len(data) / 1e6 / timeit(run, warmup=1, repeat=repeat).median


def _saves(root: str, parts: tuple[dict, dict], repeat: int) -> list[dict]:
    rows = []
    for async_mode in ("disabled", "async"):
        fns = {on: _saver(os.path.join(root, f"{async_mode}-{on}"), async_mode, parts, on) for on in (True, False)}
        timings: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for on in fns:
            fns[on]()  # warm-up
        for _ in range(repeat):
            for on, fn in fns.items():
                timings[on].append(fn())
        medians = {on: [sorted(t[i] for t in timings[on])[len(timings[on]) // 2] for i in (0, 1)] for on in fns}
        rows.append(
            {
                "mode": "sync" if async_mode == "disabled" else "async",
                "blocking_s_with": round(medians[True][0], 4),
                "blocking_s_without": round(medians[False][0], 4),
                "total_s_with": round(medians[True][1], 4),
                "total_s_without": round(medians[False][1], 4),
                "checksum_share_of_total": round(1 - medians[False][1] / medians[True][1], 4),
                "blocking_share": round(1 - medians[False][0] / medians[True][0], 4),
                "total_s_min_with": round(min(t[1] for t in timings[True]), 4),
                "total_s_min_without": round(min(t[1] for t in timings[False]), 4),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--folder", default="", help="where to save (default: a temporary folder on local disk)")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.folder or None)
    try:
        parts = _parts()
        saves = _saves(root, parts, args.repeat)
        step_dir = next(os.path.join(root, "disabled-True", d) for d in os.listdir(os.path.join(root, "disabled-True")))
        size = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
        verify_s = timeit_each({"verify": lambda: verify_checkpoint(step_dir)}, repeat=args.repeat)["verify"].median
        shard = max((os.path.join(step_dir, f) for f in os.listdir(step_dir)), key=os.path.getsize)
        hashes = {
            name: round(_hash_rate(shard, name, args.repeat))
            for name in ("crc32", "adler32", "sha1", "sha256", "blake2b")
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "checkpoint_mb": round(size / 1e6, 1),
        "saves": saves,
        "verify": {"verify_s": round(verify_s, 4), "verify_mb_per_s": round(size / 1e6 / verify_s)},
        "hashes": hashes,
        "notes": args.note,
    }
    print(results)
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()

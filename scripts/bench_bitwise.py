"""Cost of bitwise generator/trainer parity (`generator.batch_invariant=true`) on the README's main job.

    python scripts/bench_bitwise.py --out benchmarks/bench_bitwise.json [--steps 4] [--reps 1] [--old]
        [--variants normal bitwise bitwise_proposed]

One process builds one Trainer per variant from `train_configs/grpo_reverse_debug.toml` (32 prompts
x 8 samples, 8 new tokens, debug model; `--sft_warmup.steps=0` so the untrained model samples
full-length completions, and no eval) and runs their RL steps alternately (A, B, C, A, B, C, ...),
so that load from other processes spreads over all variants. The first step of each variant is
dropped (warm-up); the medians of the per-phase times over the rest are reported. Variants:

- normal: `generator.batch_invariant=false`.
- bitwise: `generator.batch_invariant=true`, the library as it is (the paged attention calls
  `attend_exact` once per sequence, packed training rows once per document).
- bitwise_proposed: the same, with `PagedAttention._attend_exact` replaced (here, by
  monkeypatching) by one `attend_exact_batched` call over all sequences of the step, and
  `PackedExactAttention.attend` (packed training rows) by one `attend_exact_spans` call over all
  documents: the changes proposed for `titanrl/generator/paged_attention.py` and
  `titanrl/models/packing.py`.
- bitwise_old (with --old, slow: minutes per step): the previous implementation (every matmul as an
  elementwise product + sum, attention one query at a time), kept here only for comparison.

Every bitwise variant must log `gen_logprob_diff == 0` (checked).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from titanrl.config import load_config  # noqa: E402
from titanrl.generator import paged_attention  # noqa: E402
from titanrl.models import batch_invariant, packing  # noqa: E402
from titanrl.trainer import Trainer  # noqa: E402

PHASES = ["sync", "generate", "reward", "logprob", "train"]


def batched_paged_attend_exact(self, q_NHD, k_cache, v_cache):
    """Proposed body of `PagedAttention._attend_exact`: one call for all sequences of the step."""
    pos_SQ = self.positions_1N[0][self.query_index_SQ]  # padding query slots: any real position
    out_SQHD = batch_invariant.attend_exact_batched(
        q_NHD[self.query_index_SQ], k_cache[self.gather_slots_SL], v_cache[self.gather_slots_SL], pos_SQ
    )
    if self.decode_only:
        return out_SQHD[:, 0]
    out_NHD = q_NHD.new_zeros(q_NHD.shape[0] + 1, *q_NHD.shape[1:])
    out_NHD[self.scatter_index_SQ.flatten()] = out_SQHD.flatten(0, 1)
    return out_NHD[:-1]


def packed_attend_exact(self, layer_id, q_BTHD, k_BTHD, v_BTHD):
    """Proposed body of `PackedExactAttention.attend`: one call for all documents of the rows."""
    return batch_invariant.attend_exact_spans(q_BTHD, k_BTHD, v_BTHD, self.spans)


# The previous implementation, for comparison only.
def _old_mm(a_MK, b_KN):
    b_NK = b_KN.t().contiguous()
    chunks = [(a.unsqueeze(1) * b_NK.unsqueeze(0)).sum(-1) for a in a_MK.split(16)]
    return torch.cat(chunks) if chunks else a_MK.new_empty(0, b_KN.shape[1])


def _old_bmm(a, b):
    return torch.stack([_old_mm(x, y) for x, y in zip(a, b)])


def _old_attend_exact(q_QHD, k_LHD, v_LHD, q_pos):
    n_rep = q_QHD.shape[1] // k_LHD.shape[1]
    k_HLD = k_LHD.repeat_interleave(n_rep, dim=1).transpose(0, 1).contiguous()
    v_HLD = v_LHD.repeat_interleave(n_rep, dim=1).transpose(0, 1).contiguous()
    scale = q_QHD.shape[-1] ** -0.5
    outs = []
    for q_HD, pos in zip(q_QHD, q_pos):
        scores_HL = (q_HD.unsqueeze(1) * k_HLD[:, : pos + 1]).sum(-1) * scale
        probs_HL = scores_HL.float().softmax(-1).to(v_HLD.dtype)
        outs.append((probs_HL.unsqueeze(-1) * v_HLD[:, : pos + 1]).sum(1))
    return torch.stack(outs)


def _old_full_attend(self, layer_id, q_BTHD, k_BTHD, v_BTHD):
    T = q_BTHD.shape[1]
    return torch.stack([_old_attend_exact(q, k, v, list(range(T))) for q, k, v in zip(q_BTHD, k_BTHD, v_BTHD)])


@contextlib.contextmanager
def patched(variant: str):
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if variant == "bitwise_proposed":
        patch(paged_attention.PagedAttention, "_attend_exact", batched_paged_attend_exact)
        patch(packing.PackedExactAttention, "attend", packed_attend_exact)
    if variant == "bitwise_old":
        patch(batch_invariant, "_mm_invariant", _old_mm)
        patch(batch_invariant, "_bmm_invariant", _old_bmm)
        patch(paged_attention, "attend_exact", _old_attend_exact)
        patch(packing, "attend_exact", _old_attend_exact)
        patch(batch_invariant.ExactCausalAttention, "attend", _old_full_attend)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="RL steps per variant (the first is dropped)")
    p.add_argument("--reps", type=int, default=1, help="fresh trainers per variant (steps alternate within a rep)")
    p.add_argument("--old", action="store_true", help="also run the previous elementwise implementation (slow)")
    p.add_argument("--variants", nargs="*", default=["normal", "bitwise", "bitwise_proposed"],
                   help="which of normal, bitwise, bitwise_proposed to run ('normal' is the baseline)")
    p.add_argument("--extra", nargs="*", default=[], help="more --section.key=value overrides for every variant")
    p.add_argument("--include", nargs="*", default=[], help="earlier JSON results of this script to keep in --out")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = list(dict.fromkeys(["normal", *a.variants])) + (["bitwise_old"] if a.old else [])
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
    base = [f"--job.config_file={config}", "--sft_warmup.steps=0", f"--training.steps={a.steps}",
            "--metrics.eval_freq=0", "--data.num_eval_samples=8", "--job.print_config=false", *a.extra]
    rows = {v: [] for v in variants}
    for rep in range(a.reps):
        trainers = {}
        for v in variants:
            dump = os.path.join("/tmp", f"bench_bitwise_{os.getpid()}_{rep}_{v}")
            trainers[v] = Trainer(load_config([*base, f"--job.dump_folder={dump}",
                                               f"--generator.batch_invariant={str(v != 'normal').lower()}"]))
        loaders = {v: iter(t.recipe.loader) for v, t in trainers.items()}
        for step in range(1, a.steps + 1):
            for v, t in trainers.items():
                with patched(v):
                    t0 = time.perf_counter()
                    m = t.recipe.step(loaders[v], step)
                    wall = time.perf_counter() - t0
                if v != "normal" and m["gen_logprob_diff"] != 0.0:
                    raise AssertionError(f"{v}: generator and trainer logprobs differ ({m['gen_logprob_diff']})")
                row = {ph: m.get(f"time_{ph}", 0.0) for ph in PHASES}
                row.update(step=step, wall=wall, gen_logprob_diff=m["gen_logprob_diff"], response_len=m["response_len"])
                times = " ".join(f"{k} {row[k]:.3f}" for k in ["generate", "train", "wall"])
                print(f"rep {rep} step {step} {v:22s} {times}", flush=True)
                if step > 1:
                    rows[v].append(row)
        for t in trainers.values():
            t.close()
    # Load from other processes only adds time: the minimum is the least disturbed step.
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in [*PHASES, "wall"]} for v, rs in rows.items()}
    minimum = {v: {k: min(r[k] for r in rs) for k in [*PHASES, "wall"]} for v, rs in rows.items()}
    ratios = {v: {k: summary[v][k] / summary["normal"][k] for k in ["generate", "train", "wall"]}
              for v in variants if v != "normal"}
    min_ratios = {v: {k: minimum[v][k] / minimum["normal"][k] for k in ["generate", "train", "wall"]}
                  for v in variants if v != "normal"}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "blas": "MKL" if torch.backends.mkl.is_available() else "other"},
        "command": "python scripts/bench_bitwise.py " + " ".join(sys.argv[1:]),
        "job": "train_configs/grpo_reverse_debug.toml " + " ".join(base[1:]),
        "method": "variants alternate step by step in one process; first step of each trainer dropped; "
                  "medians and minima over the other steps (s)",
        "median_s": summary,
        "ratio_to_normal": ratios,
        "min_s": minimum,
        "min_ratio_to_normal": min_ratios,
        "steps": rows,
        "earlier_runs": [{k: v for k, v in json.load(open(f)).items() if k != "earlier_runs"} for f in a.include],
    }
    print(json.dumps({"median_s": summary, "ratio_to_normal": ratios, "min_ratio_to_normal": min_ratios}, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

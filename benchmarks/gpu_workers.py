"""bench_gpu.py's sections that run in a process of their own (`bench_gpu.py --worker KIND`, in
its own process group, killed with it past its time cap): the GRPO step of a real recipe and vLLM's
decode, with the one decode measurement (`time_decode`) titanrl's generator and vLLM share."""

import argparse
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import torch

from benchmarks.harness import REPO_ROOT, timed_call
from titanrl.models.args import TransformerModelArgs

VLLM_BATCH_SIZES = [1, 64, 256]
# Process groups of the running workers: bench_gpu.sh's `timeout` signals only its own process
# group and a worker runs in a session of its own, so SIGTERM kills them here.
ACTIVE_GROUPS: set[int] = set()


def time_decode(run, batch: int, new_tokens: int, device: torch.device) -> tuple[dict, object]:
    """Seconds of `run(new_tokens)` after one warm-up call and of `run(1)` (prefill + one token),
    the decode rate from their difference, and what the timed `run(new_tokens)` returned. The
    one measurement of titanrl's generator and of vLLM."""
    run(new_tokens)  # warm-up (and compilation / graph capture of this batch bucket)
    total, out = timed_call(functools.partial(run, new_tokens), device)
    prefill, _ = timed_call(functools.partial(run, 1), device)  # prefill (+ one token), out of the decode time
    decode_s = max(total - prefill, 1e-9)
    return {
        "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "prefill_s": prefill,
        "generate_s": total,
        "tok_s": batch * new_tokens / total,
    }, out


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def on_sigterm(signum, frame) -> None:
    for pgid in list(ACTIVE_GROUPS):
        kill_group(pgid)
    sys.exit(128 + signum)


def tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def run_worker(kind: str, cfg: dict, workdir: str, timeout_s: float, cuda: bool) -> dict | str:
    """`cfg` to a `--worker kind` process; its result dict, or a string saying why there is none.
    Past `timeout_s` its whole process group (the trainer it launched, vLLM's engine) is killed.
    Without `cuda` (a dry run) it sees no GPU, as the trainer would otherwise take one."""
    cfg_path, log = os.path.join(workdir, f"{kind}_config.json"), os.path.join(workdir, f"{kind}.log")
    result = os.path.join(workdir, f"{kind}_result.json")
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "result": result}, f)
    cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--worker", kind, "--worker-config", cfg_path]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""}),
    }
    start = time.perf_counter()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True
        )
        ACTIVE_GROUPS.add(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc.pid)  # also what it left behind after a normal exit
            proc.wait()
            ACTIVE_GROUPS.discard(proc.pid)
    if not os.path.exists(result):
        if rc is None:
            return f"skipped: over its time cap of {timeout_s:.0f} s; log tail: {tail(log, 600)}"
        return f"failed: exit code {rc}; log tail: {tail(log)}"
    with open(result) as f:
        out = json.load(f)
    if "error" in out:
        return f"failed: {out['error']}"
    out["wall_s"] = time.perf_counter() - start
    return out


def rl_step_worker(cfg: dict) -> dict:
    """A few GRPO steps of the recipe (bench_rl_step.run_titanrl), median seconds per phase."""
    from benchmarks.bench_rl_step import run_titanrl

    a = argparse.Namespace(
        **{k: cfg[k] for k in ("steps", "batch_size", "group_size", "max_new_tokens", "lr", "threads")}
    )
    out = run_titanrl(a, cfg["model"], cfg["jsonl"], cfg["workdir"], compiled=cfg.get("compile", False))
    return {"step_s": out["step_s"], "phases_s": out["phases_s"], "response_len": out["response_len"]}


def _vllm_generate(llm, prompts: list[dict], n: int) -> int:
    """vLLM's greedy generation of `n` tokens for every prompt (EOS ignored); tokens generated."""
    from vllm import SamplingParams as VllmSamplingParams

    params = VllmSamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def vllm_worker(cfg: dict) -> dict:
    """vLLM's decode rate on the HF folder, measured as titanrl's (time_decode)."""
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=cfg["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=cfg["gpu_memory_utilization"],
        enforce_eager=cfg["enforce_eager"],
        max_model_len=cfg["prompt_len"] + cfg["new_tokens"] + 16,
        max_num_seqs=max(cfg["batch_sizes"]),
        enable_prefix_caching=False,
    )  # titanrl's decode runs without it; repeats would hit the cache
    startup = time.perf_counter() - start
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in cfg["batch_sizes"]:
        ids = torch.randint(0, cfg["vocab_size"], (b, cfg["prompt_len"]), generator=g).tolist()
        prompts = [{"prompt_token_ids": p} for p in ids]  # a TokensPrompt
        run = functools.partial(_vllm_generate, llm, prompts)
        # generate() returns finished requests (host token ids): no device sync needed here.
        timing, generated = time_decode(run, b, cfg["new_tokens"], torch.device("cpu"))
        rows.append({"batch": b, **timing, "generated_tokens": generated})
        print(f"  vllm decode batch {b}: {timing['decode_tok_s']:,.0f} tok/s", flush=True)
    return {"version": vllm.__version__, "startup_s": startup, "rows": rows}


def worker_main(kind: str, cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    try:
        out = rl_step_worker(cfg) if kind == "rl_step" else vllm_worker(cfg)
    except Exception as e:  # reported in the JSON, never fatal to the benchmark
        out = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    with open(cfg["result"] + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(cfg["result"] + ".tmp", cfg["result"])
    # Now, without waiting on vLLM's shutdown (it can hang); the parent kills what is left.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def compare_with_vllm(titanrl_rows: list[dict], vllm_out: dict) -> list[dict]:
    """titanrl's and vLLM's rows side by side at the batch sizes both ran, ratios titanrl / vLLM."""
    ours = {r["batch"]: r for r in titanrl_rows}
    rows = []
    for v in vllm_out["rows"]:
        t = ours.get(v["batch"])
        if t is None:
            continue
        rows.append(
            {
                "batch": v["batch"],
                "titanrl_decode_tok_s": t["decode_tok_s"],
                "vllm_decode_tok_s": v["decode_tok_s"],
                "titanrl_over_vllm_decode": t["decode_tok_s"] / v["decode_tok_s"],
                "titanrl_tok_s": t["tok_s"],
                "vllm_tok_s": v["tok_s"],
                "titanrl_over_vllm": t["tok_s"] / v["tok_s"],
                "titanrl_prefill_s": t["prefill_s"],
                "vllm_prefill_s": v["prefill_s"],
                "vllm_generated_tokens": v["generated_tokens"],
            }
        )
    return rows


def rl_step_section(
    rl: dict, flavor: str, model_dir: str, jsonl: str, workdir: str, left, cuda: bool, a: argparse.Namespace
) -> dict | str:
    cap = min(a.rl_timeout, left() - 10)
    if cap < 20:
        return f"skipped: {left():.0f} s left of the {a.budget_s:.0f} s budget"
    print(f"rl step ({flavor}, {rl['steps']} steps, cap {cap:.0f} s):", flush=True)
    out = run_worker(
        "rl_step",
        {**rl, "model": model_dir, "jsonl": jsonl, "workdir": workdir, "compile": False if a.eager else None},
        workdir,
        cap,
        cuda,
    )
    if not isinstance(out, dict):
        print(f"  {out[:300]}", flush=True)
        return out
    print("  " + ", ".join(f"{k} {v:.3f} s" for k, v in out["phases_s"].items()), flush=True)
    return {
        "recipe": "train_configs/grpo_reverse_debug.toml",
        "runner": "benchmarks/bench_rl_step.py:run_titanrl",
        "model": f"{flavor} flavor's shape, random weights (bf16 HF folder), character tokenizer",
        "device": "cuda" if cuda else "cpu",
        **rl,
        "steps_timed": rl["steps"] - 1,
        **out,
    }


def vllm_section(
    model_dir: str,
    flavor: str,
    shape: TransformerModelArgs,
    titanrl_rows: list[dict],
    prompt_len: int,
    new_tokens: int,
    workdir: str,
    left,
    cuda: bool,
    a: argparse.Namespace,
) -> dict | str:
    if importlib.util.find_spec("vllm") is None:
        return "not installed"
    if not cuda:
        return "skipped: --dry-run (CPU)"
    if left() - 10 < a.vllm_min_s:
        return f"skipped: {left():.0f} s left of the {a.budget_s:.0f} s budget, needs {a.vllm_min_s:.0f}"
    cap = min(a.vllm_timeout, left() - 10)
    print(f"vllm ({flavor}, cap {cap:.0f} s):", flush=True)
    cfg = {
        "model": model_dir,
        "vocab_size": shape.vocab_size,
        "batch_sizes": VLLM_BATCH_SIZES,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "gpu_memory_utilization": a.vllm_gpu_memory_utilization,
        "enforce_eager": a.vllm_eager,
    }
    out = run_worker("vllm", cfg, workdir, cap, cuda)
    if not isinstance(out, dict):
        print(f"  {out[:300]}", flush=True)
        return out
    out = {
        "model": f"{flavor} flavor's shape, random weights, bf16 (the folder the RL step loads)",
        "enforce_eager": a.vllm_eager,
        "titanrl_compile": not a.eager,
        "gpu_memory_utilization": a.vllm_gpu_memory_utilization,
        **out,
        "vs_titanrl": compare_with_vllm(titanrl_rows, out),
    }
    for r in out["vs_titanrl"]:
        print(f"  batch {r['batch']}: titanrl / vLLM decode {r['titanrl_over_vllm_decode']:.2f}x", flush=True)
    return out

"""The user-facing scripts run for real on files they are given; the benchmarks share one harness
and every benchmark JSON says which commit, device and command made it."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import torch
from helpers import background
from helpers.launch import REPO_ROOT
from helpers.reference import greedy_reference
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.models.hf import export_hf
from titanrl.models.tokenizer import ByteTokenizer


def test_generate_cli_on_hf_folder(tmp_path):
    args = tiny_model_args(vocab_size=264, max_seq_len=64)
    model = tiny_model(args, 0)
    export_hf(model, str(tmp_path))
    cmd = [
        sys.executable,
        os.path.join(REPO_ROOT, "scripts", "generate.py"),
        "--hf_checkpoint",
        str(tmp_path),
        "--prompt",
        "12+34=",
        "--prompt",
        "hello",
        "--max_new_tokens",
        "8",
        "--num_blocks",
        "32",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    lines = [json.loads(line) for line in out.strip().splitlines()]
    completions, stats = lines[:-1], lines[-1]["stats"]
    assert [c["prompt"] for c in completions] == ["12+34=", "hello"]
    tok = ByteTokenizer()
    for c in completions:
        ref_ids, _ = greedy_reference(model.eval(), tok.encode(c["prompt"]), 8, eos_id=tok.eos_id)
        assert c["token_ids"] == ref_ids
        assert c["text"] == tok.decode(ref_ids)
    assert stats["decode_tokens"] > 0


# The dry runs, in the background from collection on (helpers/background.py).
background.register(
    "bench_gpu",
    ("tests/test_scripts.py::test_bench_gpu_dry_run_writes_a_complete_report",),
    lambda folder: [
        "bash",
        os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh"),
        "--dry-run",
        "--out",
        f"{folder}/bench_gpu.json",
    ],
    {"OMP_NUM_THREADS": "1"},
)
background.register(
    "bench_gpt_oss",
    ("tests/test_scripts.py::test_bench_gpu_gpt_oss_dry_run",),
    lambda folder: ["bash", os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh"), "--gpt-oss-only", "--dry-run"],
)


def test_bench_gpu_dry_run_writes_a_complete_report():
    """The GPU benchmark's own code path, on a tiny model on CPU: every number is present,
    positive and self-consistent, so that the one H200 run is right on the first try."""
    proc, folder = background.result("bench_gpu", timeout_s=300)
    out = folder / "bench_gpu.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written["device"].startswith("cpu: ") and len(written["commit"]) == 40
    assert written["command"] == f"bash scripts/bench_gpu.sh --dry-run --out {out}"
    report = written["results"]
    assert report["dry_run"] is True and report["copy_bandwidth_gb_s"] > 0
    (entry,) = report["models"].values()
    assert entry["params"] > 1e6
    for row in entry["decode"]:
        assert row["decode_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["fraction_of_roofline"] == row["decode_tok_s"] / row["roofline_tok_s"]
        assert row["decode_steps"] >= report["config"]["new_tokens"]
        assert row["tok_s"] > 0 and row["generate_s"] > 0
        assert row["compile_s"] >= 0
    (att,) = entry["decode_attention"]  # FlexAttention and the in-place form agree, both timed
    assert att["max_abs_diff"] < 1e-4 and att["flex_ms"] > 0 and att["inplace_ms"] > 0
    gen = report["generator"]
    assert [r["prompt_len"] for r in gen["prefill"]] == [32, 64] and all(r["prefill_tok_s"] > 0 for r in gen["prefill"])
    tail = gen["long_tail"]
    assert tail["samples"] == 8 and 0 < tail["len_p50"] <= tail["len_max"] <= tail["max_new_tokens"]
    assert tail["tok_s"] > 0 and tail["decode_steps"] >= tail["len_max"] - 1
    assert gen["warm_compile"]["generate_s"] > 0 and "cold_compile_s_in_this_process" in gen["warm_compile"]
    assert entry["train"]["tokens_per_s"] > 0 and entry["train"]["mfu"] is None  # no peak known on CPU
    assert entry["weight_sync"]["sync_s"] > 0
    moe = report["moe"]  # the same entry for an MoE model; its MFU counts the active parameters
    assert moe["model"] == "debug-moe" and moe["params"] > entry["params"]
    assert all(row["decode_tok_s"] > 0 for row in moe["decode"]) and moe["train"]["tokens_per_s"] > 0
    assert moe["train"]["tflops"] < moe["train"]["tokens_per_s"] * 6 * moe["params"] / 1e12
    assert moe["weight_sync"]["sync_s"] > 0
    # A real GRPO recipe, 2 steps on CPU (the first dropped), split by phase.
    rl = report["rl_step"]
    assert isinstance(rl, dict), rl  # a string says why it did not run
    assert rl["steps"] == 2 and rl["steps_timed"] == 1 and rl["device"] == "cpu"
    assert set(rl["phases_s"]) == {"sync", "generate", "reward", "logprob", "train"}
    assert all(v >= 0 for v in rl["phases_s"].values()) and rl["phases_s"]["generate"] > 0
    assert abs(rl["step_s"] - sum(rl["phases_s"].values())) < 1e-9
    assert 0 < rl["response_len"] <= rl["max_new_tokens"]
    # vLLM never runs in a dry run; the key says why.
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert report["vllm"] == ("skipped: --dry-run (CPU)" if has_vllm else "not installed")


def test_bench_gpu_gpt_oss_dry_run():
    """`--gpt-oss-only --dry-run`: the gpt-oss section's code path on debug-gpt-oss on the CPU."""
    proc, _ = background.result("bench_gpt_oss", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith('{"gpt_oss_bench"'))
    report = json.loads(line)["gpt_oss_bench"]
    assert report["model"] == "debug-gpt-oss" and report["dry_run"] is True
    assert 0 < report["matmul_active_params"] < report["params"]
    assert [row["batch"] for row in report["decode"]] == [1, 4]
    for row in report["decode"]:
        assert row["decode_tok_s"] > 0 and row["fraction_of_roofline"] == row["decode_tok_s"] / row["roofline_tok_s"]
    train = report["train"]
    assert train["seq"] > 32 and train["tokens_per_s"] > 0 and train["mfu"] is None  # past the window; no CPU peak
    assert train["tflops"] < train["tokens_per_s"] * 6 * report["params"] / 1e12  # active, not total


def test_bench_gpu_refuses_to_run_without_a_gpu():
    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stderr


def _load(name: str, *path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, *path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_harness_times_and_writes_commit_device_and_command(tmp_path):
    harness = _load("bench_harness", "benchmarks", "harness.py")
    calls = []
    timing = harness.timeit(lambda: calls.append(1), warmup=2, repeat=3)
    assert len(calls) == 5 and len(timing.times) == 3 and timing.min <= timing.median <= max(timing.times)
    argv = [os.path.join(REPO_ROOT, "benchmarks", "bench_x.py"), "--out", "a b.json"]
    harness.write_json(str(tmp_path / "x.json"), {"t": timing}, command=argv)
    report = json.loads((tmp_path / "x.json").read_text())
    assert list(report) == ["commit", "device", "command", "environment", "results"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    assert report["commit"] == report["environment"]["commit"] == head
    assert isinstance(report["environment"]["dirty"], bool)
    assert report["device"].startswith("cpu: ") and report["environment"]["torch"] == torch.__version__
    assert report["command"] == "python -m benchmarks.bench_x --out 'a b.json'"
    assert report["results"]["t"]["times"] == timing.times
    assert harness.read_results(str(tmp_path / "x.json")) == (report["results"], head)


def test_every_benchmark_json_records_its_commit_device_and_command():
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "*.json"))):
        with open(path) as f:
            report = json.load(f)
        assert len(report["commit"]) == 40 and report["device"] and report["command"], path


def test_every_benchmark_imports_and_names_its_main_results():
    """Each benchmark imports as `benchmarks.<name>` (how they run: `python -m`), with the docstring
    and DOC_TABLES that docs/benchmarks.md is made from."""
    names = [os.path.basename(p)[:-3] for p in sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "bench_*.py")))]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    m = importlib.import_module('benchmarks.' + n)\n"
    code += "    assert m.__doc__ and m.DOC_TABLES, n\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_benchmarks_page_is_regenerated_from_the_jsons():
    gen = _load("gen_benchmark_docs", "scripts", "gen_benchmark_docs.py")
    with open(os.path.join(REPO_ROOT, "docs", "benchmarks.md")) as f:
        assert f.read() == gen.render(), "docs/benchmarks.md is stale: run python scripts/gen_benchmark_docs.py"

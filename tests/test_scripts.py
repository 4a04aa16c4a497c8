"""The user-facing scripts run for real on files they are given."""

import json
import os
import subprocess
import sys

import torch
from conftest import REPO_ROOT

from titanrl.generator.reference import greedy_reference
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.hf import export_hf
from titanrl.models.tokenizer import ByteTokenizer


def test_generate_cli_on_hf_folder(tmp_path):
    args = TransformerModelArgs(
        family="qwen3",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=96,
        vocab_size=264,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
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


def test_bench_gpu_dry_run_writes_a_complete_report(tmp_path):
    """The GPU benchmark's own code path, on a tiny model on CPU: every number is present,
    positive and self-consistent, so that the one H200 run is right on the first try."""
    import importlib.util

    out = tmp_path / "bench_gpu.json"
    proc = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["copy_bandwidth_gb_s"] > 0
    (entry,) = report["models"].values()
    assert entry["params"] > 1e6
    for row in entry["decode"]:
        assert row["decode_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["fraction_of_roofline"] == row["decode_tok_s"] / row["roofline_tok_s"]
        assert row["decode_steps"] >= report["config"]["new_tokens"]
        assert row["tok_s"] > 0 and row["generate_s"] > 0
    assert entry["train"]["tokens_per_s"] > 0 and entry["train"]["mfu"] is None  # no peak known on CPU
    assert entry["weight_sync"]["sync_s"] > 0
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


def test_bench_gpu_refuses_to_run_without_a_gpu():
    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "bench_gpu.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stderr

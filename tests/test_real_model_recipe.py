"""The real-model recipe (train_configs/grpo_qwen2.5_0.5b_gsm8k.toml) on CPU: the same file, a
tiny random checkpoint with the real 151,936-token vocabulary, a real BPE tokenizer.json with
Qwen's special ids and ChatML template, verl-style GSM8K Parquet rows and the math verifier."""

import json
import math
import os

import pytest
import torch
from helpers.tiny import tiny_model

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
pyarrow = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402
from helpers.launch import REPO_ROOT  # noqa: E402
from helpers.real_vocab import write_qwen_layout_folder  # noqa: E402

from titanrl.config import load_config  # noqa: E402
from titanrl.models import TransformerModelArgs  # noqa: E402
from titanrl.models.hf import export_hf  # noqa: E402
from titanrl.train import build_trainer  # noqa: E402

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_qwen2.5_0.5b_gsm8k.toml")
QUESTIONS = [
    ("Natalia sold 48 clips in April and half as many in May. How many in total?", "72"),
    ("What is 6 times 7?", "42"),
    ("What is 10 plus 5?", "15"),
    ("Half of 84?", "42"),
    ("What is 9 times 9?", "81"),
    ("What is 100 minus 1?", "99"),
]


def _verl_rows():
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "user", "content": q + ' Let\'s think step by step and output the final answer after "####".'}
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (q, a) in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_like")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    write_qwen_layout_folder(tokenizer)
    args = TransformerModelArgs(
        family="qwen2",
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=64,
        vocab_size=151_936,
        rope_theta=1e6,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_seq_len=512,
    )
    model = tiny_model(args, 0)
    export_hf(model, str(root / "model"))
    # Qwen lists two stop tokens: <|im_end|> and <|endoftext|>.
    (root / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    pq.write_table(pyarrow.Table.from_pylist(_verl_rows()), root / "train.parquet")
    return root


def _args(assets, folder):
    return [
        f"--job.config_file={CONFIG}",
        f"--job.dump_folder={folder}",
        f"--model.hf_checkpoint={assets / 'model'}",
        f"--model.tokenizer={assets / 'tokenizer'}",
        f"--data.path={assets / 'train.parquet'}",
        "--model.max_seq_len=256",
        "--training.steps=2",
        "--training.batch_size=2",
        "--algorithm.group_size=2",
        "--generator.max_new_tokens=6",
        "--generator.num_blocks=64",
        "--data.num_eval_samples=2",
        "--reward.num_workers=1",
        "--metrics.eval_freq=0",
        "--checkpoint.enable=false",
        "--checkpoint.export_hf=false",
    ]


def test_real_model_recipe_runs_on_cpu_at_real_vocabulary(assets, tmp_path):
    trainer = build_trainer(load_config(_args(assets, tmp_path)))
    assert trainer.model_args.vocab_size == trainer.tokenizer.vocab_size == 151_936
    assert trainer.recipe.generator.eos_ids == {151645, 151643}
    # The recipe's bf16: float32 master weights, a bf16 generator (on one rank, as on one GPU).
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.dtype for p in trainer.recipe.generator.model.parameters()} == {torch.bfloat16}
    # Prompts are the rows' messages through the ChatML template, ending in the generation prompt.
    sample = trainer.recipe.eval_samples[0]
    ids = trainer.encode_prompt(sample.prompt, sample.metadata)
    generation_prompt = [151644, *trainer.tokenizer.encode("assistant\n")]
    assert ids[0] == 151644 and ids[-len(generation_prompt) :] == generation_prompt
    assert sample.answer == QUESTIONS[0][1] and sample.metadata["data_source"] == "openai/gsm8k"
    result = trainer.train()
    trainer.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["grad_norm"]) and 0.0 <= r["reward_mean"] <= 1.0 and r["reward_failures"] == 0
        assert r["gen_logprob_diff"] < 1e-4  # generator vs trainer (chunked) logprobs at the real vocabulary
    assert result["eval_samples"] == 2

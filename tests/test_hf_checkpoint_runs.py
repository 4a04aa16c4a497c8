"""`[model] hf_checkpoint` for the new families: the debug GRPO job (byte tokenizer, reverse
task) starts from a tiny random gpt-oss / DeepSeek-V3 folder saved by transformers, its policy
holds the folder's weights before it trains, and one RL step runs in this process."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_deepseek_v3  # noqa: E402
import test_gpt_oss  # noqa: E402
from helpers.tiny import smoke_run_args  # noqa: E402

from titanrl.config import load_config  # noqa: E402
from titanrl.models.hf import load_hf_weights, read_hf_config  # noqa: E402
from titanrl.models.model import Transformer  # noqa: E402
from titanrl.train import build_trainer  # noqa: E402


def _folder(family: str, tmp_path) -> str:
    if family == "gpt_oss":
        hf_model = test_gpt_oss._tiny_hf(0.2)
    else:
        hf_model = test_deepseek_v3._tiny_hf(*test_deepseek_v3.CONFIGS["q_lora-yarn-std0.2-bias"])
    folder = tmp_path / family
    hf_model.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_run_trains_from_an_hf_checkpoint_folder(family, tmp_path):
    folder = _folder(family, tmp_path)
    run = tmp_path / "run"
    argv = smoke_run_args(
        f"--job.dump_folder={run}",
        f"--model.hf_checkpoint={folder}",
        "--generator.block_size=4",
        steps=1,
        sft_steps=0,
        batch_size=2,
        group_size=2,
        max_new_tokens=4,
        eval_samples=0,
    )
    trainer = build_trainer(load_config(argv))
    with torch.device("meta"):
        expected = Transformer(read_hf_config(folder))
    expected.to_empty(device="cpu")
    expected.init_weights()
    load_hf_weights(expected, folder)
    loaded = dict(trainer.model.named_parameters())
    for name, p in expected.named_parameters():
        assert torch.equal(loaded[name].detach().float(), p.float()), name
    trainer.train()
    trainer.close()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1]

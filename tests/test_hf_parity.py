"""Numerical parity with `transformers` through the HF safetensors adapter (fp32, CPU)."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titanrl.models import Transformer  # noqa: E402
from titanrl.models.hf import (  # noqa: E402
    SAFETENSORS_INDEX,
    export_hf,
    load_hf_weights,
    read_hf_config,
)

TOL = 1e-4  # max |logit diff| allowed in fp32


def _tiny_hf_model(family: str, tie: bool):
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        # head_dim != hidden/heads exercises Qwen3's explicit head_dim.
        cfg = transformers.Qwen3Config(
            **common, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    # Random (non-default) norms and biases so that a mis-mapped weight changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


def _hf_logits(model, tokens_BT):
    with torch.no_grad():
        return model(input_ids=tokens_BT).logits


def _titan_from_folder(folder: str) -> Transformer:
    args = read_hf_config(folder)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, folder)
    return model.eval()


@pytest.mark.parametrize(
    "family,tie,sharded",
    [
        ("llama", False, False),
        ("llama", True, True),
        ("qwen2", True, False),
        ("qwen2", False, True),
        ("qwen3", False, False),
        ("qwen3", True, True),
    ],
)
def test_hf_roundtrip_logits(tmp_path, family, tie, sharded):
    hf_model = _tiny_hf_model(family, tie)
    src = tmp_path / "hf"
    # A small max_shard_size forces model.safetensors.index.json + several shards.
    hf_model.save_pretrained(src, max_shard_size="20KB" if sharded else "1GB")
    assert os.path.exists(src / SAFETENSORS_INDEX) == sharded

    tokens_BT = torch.randint(0, 97, (3, 37), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(hf_model, tokens_BT)

    model = _titan_from_folder(str(src))
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    with torch.no_grad():
        ours = model(tokens_BT)
    assert (ours - ref).abs().max().item() < TOL

    # Export back (sharded too) and reload in transformers: same logits again.
    dst = tmp_path / "export"
    export_hf(model, str(dst), max_shard_bytes=30_000 if sharded else 2**30)
    assert os.path.exists(dst / SAFETENSORS_INDEX) == sharded
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    assert (_hf_logits(reloaded, tokens_BT) - ref).abs().max().item() < TOL


def test_positions_match_hf_position_ids(tmp_path):
    """Explicit positions (as the generator will pass them) give HF's results for position_ids."""
    hf_model = _tiny_hf_model("qwen3", tie=False)
    hf_model.save_pretrained(tmp_path)
    model = _titan_from_folder(str(tmp_path))
    tokens_BT = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    positions_BT = torch.arange(9).repeat(2, 1) + torch.tensor([[5], [11]])
    with torch.no_grad():
        ref = hf_model(input_ids=tokens_BT, position_ids=positions_BT).logits
        ours = model(tokens_BT, positions_BT)
    assert (ours - ref).abs().max().item() < TOL


def test_unknown_weight_is_an_error(tmp_path):
    hf_model = _tiny_hf_model("qwen2", tie=False)
    hf_model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="extra_proj"):
        _titan_from_folder(str(tmp_path))


def test_unsupported_config_is_an_error(tmp_path):
    hf_model = _tiny_hf_model("qwen2", tie=False)
    hf_model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Unsupported HF model_type 'mistral'"):
        read_hf_config(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sequence_classification_reward_model_matches_transformers(tmp_path, family):
    """A one-label HF reward model loads as a titanrl score head: the score at each row's last
    real token (right padding) equals transformers' pooled logit; export reloads in transformers."""
    from titanrl.models.scalar_head import sequence_scores

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        hf = transformers.Qwen2ForSequenceClassification(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        hf = transformers.LlamaForSequenceClassification(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        hf.score.weight.normal_()
    hf = hf.eval()
    hf.save_pretrained(tmp_path / "rm")
    model = _titan_from_folder(str(tmp_path / "rm"))
    assert model.args.num_labels == 1 and model.output.weight.shape == (1, 64)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 97, (3, 9), generator=g)
    lengths = torch.tensor([9, 5, 7])
    for i, n in enumerate(lengths.tolist()):
        tokens[i, n:] = 0
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=(tokens != 0).long()).logits[:, 0]
    got = sequence_scores(model, tokens, lengths)
    assert (got - want).abs().max().item() < TOL
    export_hf(model, str(tmp_path / "out"))
    with torch.no_grad():
        again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
        again.config.pad_token_id = 0
        reloaded = again(input_ids=tokens, attention_mask=(tokens != 0).long()).logits[:, 0]
    assert (reloaded - want).abs().max().item() < TOL

import json

import pytest

from titanrl.models.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, format_prompt


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    text = "12+34=46 ünï"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3 and tok.vocab_size == 259
    # A multi-byte character cut in half decodes to a replacement char instead of raising.
    assert tok.decode(list("ü".encode())[:1]) == "\ufffd"


def _train_tiny_hf_tokenizer(folder):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["what is 12 plus 34? the answer is 46."] * 50, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    return tok


def test_hf_tokenizer_json_loader(tmp_path):
    ref = _train_tiny_hf_tokenizer(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    text = "what is 12 plus 34?"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text, add_bos=True) + [tok.eos_id]) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        ref.token_to_id("<s>"),
        ref.token_to_id("</s>"),
        ref.token_to_id("<pad>"),
    )
    assert tok.vocab_size == ref.get_vocab_size()


def test_hf_tokenizer_vocab_size_covers_the_highest_id(tmp_path):
    """A special token at a high id with a gap below it (Qwen's layout): vocab_size is the highest
    id + 1, what the model's embedding needs, not the number of entries."""
    spec = json.loads(_train_tiny_hf_tokenizer(tmp_path).to_str())
    spec["model"]["vocab"]["<|im_end|>"] = 5000
    spec["added_tokens"].append(
        {
            "id": 5000,
            "content": "<|im_end|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = HFTokenizer(str(tmp_path))
    assert tok.vocab_size == 5001 and 5000 in tok.encode("ok <|im_end|>")


def test_hf_tokenizer_eos_id_from_config_json(tmp_path):
    _train_tiny_hf_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = HFTokenizer(str(tmp_path))
    assert tok.eos_id == 2 and tok.pad_id == 2 and tok.bos_id is None


def test_missing_tokenizer_is_clear(tmp_path):
    with pytest.raises(ValueError, match="No tokenizer.json in"):
        build_tokenizer(str(tmp_path))


def test_format_prompt():
    assert format_prompt("Q: {question}\nA: ", question="1+1") == "Q: 1+1\nA: "
    with pytest.raises(ValueError, match="uses 'question' but the row only has \\['prompt'\\]"):
        format_prompt("Q: {question}", prompt="x")

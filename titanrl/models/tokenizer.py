"""Tokenizers: a protocol, a built-in byte tokenizer, and an HF `tokenizer.json` loader."""

import json
import os
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    @property
    def bos_id(self) -> int | None: ...  # read-only here: a tokenizer that always has one is a Tokenizer

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <pad>, <bos>, <eos>. Needs no files; used by embedded tasks."""

    def __init__(self) -> None:
        self.pad_id = 256
        self.bos_id = 257
        self.eos_id = 258
        self.vocab_size = 259

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        # Special ids carry no text; a cut multi-byte character decodes to U+FFFD, never raises.
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (via the optional `tokenizers` package).

    bos/eos/pad come from `tokenizer_config.json` or `config.json` beside it when present.
    """

    def __init__(self, folder: str) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError:
            raise ValueError(
                "model.tokenizer points at a tokenizer.json, which needs the 'tokenizers' package: "
                "pip install 'titanrl[hf]'"
            ) from None
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"No tokenizer.json in '{folder}' (model.tokenizer must be 'byte' or such a folder)")
        self._tok = _RustTokenizer.from_file(path)
        # Ids can have gaps (special tokens at high ids, as in Qwen's layout): the model needs a
        # row for the highest id, which a count of entries would not give.
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        special = self._special_tokens(folder)
        self.bos_id = self._id_of(special.get("bos_token"))
        eos_id = self._id_of(special.get("eos_token"))
        if eos_id is None:
            raise ValueError(f"No eos token found for '{folder}': set eos_token in tokenizer_config.json")
        self.eos_id = eos_id
        pad_id = self._id_of(special.get("pad_token"))
        self.pad_id = eos_id if pad_id is None else pad_id

    @staticmethod
    def _special_tokens(folder: str) -> dict[str, str | int]:
        """{'bos_token': '<s>' or an id, ...}; tokenizer_config.json wins over config.json."""
        special: dict[str, str | int] = {}
        for filename in ("config.json", "tokenizer_config.json"):
            path = os.path.join(folder, filename)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                cfg = json.load(f)
            for key in ("bos_token", "eos_token", "pad_token"):
                token_id = cfg.get(f"{key}_id")
                if isinstance(token_id, list):  # some configs list several eos ids
                    token_id = token_id[0] if token_id else None
                token = cfg.get(key)
                if isinstance(token, dict):  # {"content": "<s>", ...}
                    token = token.get("content")
                if token is not None or token_id is not None:
                    special[key] = token if token is not None else token_id
        return special

    def _id_of(self, token: str | int | None) -> int | None:
        if token is None or isinstance(token, int):
            return token
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str) -> Tokenizer:
    """`spec` is 'byte' or a folder with tokenizer.json (config key model.tokenizer)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def format_prompt(template: str, **fields: str) -> str:
    """Chat-template-free prompt: `template` with {field} placeholders, e.g. 'Q: {question}\\nA: '."""
    try:
        return template.format(**fields)
    except KeyError as e:
        raise ValueError(f"Prompt template {template!r} uses {e} but the row only has {sorted(fields)}") from None

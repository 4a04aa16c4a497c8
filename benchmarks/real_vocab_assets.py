"""bench_real_vocab.py's assets, all written in a temporary folder: GSM8K-like word problems, a
byte-level BPE tokenizer laid out like Qwen2.5's (151,936 ids, its special tokens, the ChatML
template) and a random-weight checkpoint of Qwen2.5-0.5B's width, exported as HF safetensors."""

import json
import os
import random

VOCAB_SIZE = 151936
QWEN_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# Qwen2's pre-tokenizer split (digits one by one), then byte-level.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's ChatML template without the tools branch: a default system prompt when none is given.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Mark", "Tina", "Randy", "Jasmine"]
ITEMS = ["clips", "apples", "cupcakes", "pencils", "stickers", "marbles", "books", "cookies"]


def make_problems(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` GSM8K-like word problems (question, numeric answer), from a few templates."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(2, 60) * 2, rng.randint(2, 12), rng.randint(2, 15)
        kind = rng.randrange(4)
        if kind == 0:
            q = (
                f"{name} sold {item} to {a} of her friends in April, and then she sold half as many {item} in "
                f"May. How many {item} did {name} sell altogether in April and May?"
            )
            ans = a + a // 2
        elif kind == 1:
            q = (
                f"{name} has {a} {item}. She buys {b} more boxes with {c} {item} in each box. How many {item} "
                f"does {name} have now?"
            )
            ans = a + b * c
        elif kind == 2:
            q = (
                f"A store sells {item} for ${c} each. {name} buys {b} {item} and pays with a $200 bill. How much "
                f"change does {name} get back?"
            )
            ans = 200 - b * c
        else:
            q = (
                f"{name} reads {b} pages a day for {c} days, then {a} pages a day for the next {b} days. How many "
                f"pages did {name} read in total?"
            )
            ans = b * c + a * b
        problems.append((f"{q} {INSTRUCTION}", str(ans)))
    return problems


def train_bpe(corpus: list[str], vocab_size: int):
    """A byte-level BPE with Qwen2's pre-tokenizer, trained on `corpus` (special tokens kept whole)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_tokenizer(folder: str, corpus: list[str], bpe_vocab: int) -> None:
    """tokenizer.json in Qwen2.5's id layout, padded to VOCAB_SIZE ids, and tokenizer_config.json
    with the ChatML template (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    spec = json.loads(train_bpe(corpus, bpe_vocab).to_str())
    vocab = spec["model"]["vocab"]
    for token in QWEN_SPECIAL:
        del vocab[token]
    vocab = {t: i for i, t in enumerate(sorted(vocab, key=vocab.get))}  # BPE tokens at 0..n-1
    used = set(vocab.values()) | set(QWEN_SPECIAL.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(VOCAB_SIZE) if i not in used})
    vocab.update(QWEN_SPECIAL)
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in QWEN_SPECIAL.items()
    ]
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "chat_template": CHATML,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def model_args(n_layers: int):
    """Qwen2.5-0.5B's shape (the `qwen2.5-0.5b` flavor) with `n_layers` layers."""
    from titanrl.models.flavors import get_model_args

    args = get_model_args("qwen2.5-0.5b")
    args.n_layers = n_layers
    return args


def write_checkpoint(folder: str, n_layers: int, seed: int) -> int:
    """A random-weight HF checkpoint exported by titanrl, with Qwen2.5's special ids in config.json
    and generation_config.json; returns the parameter count."""
    import torch

    from titanrl.models.hf import export_hf
    from titanrl.models.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(model_args(n_layers))
    model.init_weights()
    export_hf(model, folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}, f)
    return sum(p.numel() for p in model.parameters())


def write_prompts(workdir: str, problems: list[tuple[str, str]]) -> tuple[str, str]:
    """(titanrl's JSONL of text prompts, TRL's JSON of one-user-message conversations)."""
    jsonl, trl_json = os.path.join(workdir, "prompts.jsonl"), os.path.join(workdir, "prompts.json")
    with open(jsonl, "w") as f:
        for q, a in problems:
            f.write(json.dumps({"prompt": q, "answer": a}) + "\n")
    with open(trl_json, "w") as f:
        json.dump([{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in problems], f)
    return jsonl, trl_json


def titanrl_prompt_ids(folder: str, problems: list[tuple[str, str]]) -> list[list[int]]:
    """The prompts as titanrl's trainer encodes them (ChatML, generation prompt)."""
    from titanrl.data.encode import PromptEncoder
    from titanrl.models.chat_template import ChatTemplate
    from titanrl.models.tokenizer import HFTokenizer

    encode = PromptEncoder(HFTokenizer(folder), ChatTemplate.from_folder(folder))
    return [encode(q) for q, _ in problems]

"""A real-vocabulary tokenizer folder for tests: a small byte-level BPE trained here, laid out
like Qwen2.5's (151,936 ids, <|endoftext|> / <|im_start|> / <|im_end|> at 151643-151645, the
ChatML template), so that tests exercise real ids and a real template without a download."""

import json

import tokenizers

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
CORPUS = [
    "You are a helpful assistant. What is the weather in Paris today?",
    "The answer is 42. Let's think step by step: 6 times 7 is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Call the get_weather function with the city name and the unit celsius.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} returned {"temperature": 21}',
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou have access to functions.",
]

# Qwen2.5's template (ChatML): a default system prompt when none is given, a tools section, <tool_call>s.
QWEN = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN_CONFIG = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN}


def train_bpe():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def write_qwen_layout_folder(tmp_path) -> None:
    """tokenizer.json padded to 151,936 ids, tokenizer_config.json with the ChatML template and
    config.json's vocab size, in `tmp_path` (a pathlib.Path)."""
    tok = train_bpe()
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for token in SPECIAL:
        del vocab[token]
    vocab = {t: i for i, t in enumerate(sorted(vocab, key=vocab.get))}  # BPE tokens at 0..n-1
    qwen_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    fill = iter(t for t in SPECIAL if t not in qwen_ids)
    id_of = {**qwen_ids, **{next(fill): i for i in range(151646, 151646 + len(SPECIAL) - 3)}}
    used = set(vocab.values()) | set(id_of.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(151936) if i not in used})  # padding ids
    vocab.update(id_of)
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
        for t, i in sorted(id_of.items(), key=lambda x: x[1])
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(QWEN_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936, "eos_token_id": 151645}))

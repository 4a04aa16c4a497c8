"""Chat templates: titanrl's rendering and token ids against transformers' apply_chat_template on
real BPE tokenizer folders (trained here with `tokenizers`), and the assistant mask."""

import json

import pytest

pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from helpers.real_vocab import QWEN_CONFIG, train_bpe, write_qwen_layout_folder  # noqa: E402

from titanrl.models.chat_template import ChatTemplate, load_chat_template  # noqa: E402
from titanrl.models.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

# Llama 3.1 style: bos, header ids, a dated system header (strftime_now), tools as indented JSON.
LLAMA3 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, respond with JSON.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral style multi-turn assistant/tool structure: tools before the last user turn, the system
# prompt inside it, [TOOL_CALLS] / [TOOL_RESULTS], namespace + loop controls, {% generation %} spans
# and raise_exception on an unknown role.
MISTRAL = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
    {%- if message.role != 'user' %}
        {%- continue %}
    {%- endif %}
    {%- set ns.last_user = loop.index0 %}
{%- endfor %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- if tools is not none and loop.index0 == ns.last_user %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' }}
        {%- if system_message is defined and loop.index0 == ns.last_user %}
            {{- system_message + '\n\n' }}
        {%- endif %}
        {{- message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- generation %}
        {%- if message.tool_calls is defined %}
            {{- '[TOOL_CALLS][' }}
            {%- for call in message.tool_calls %}
                {{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}
                {%- if not loop.last %}
                    {{- ', ' }}
                {%- endif %}
            {%- endfor %}
            {{- ']' }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- eos_token }}
        {%- endgeneration %}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + {'call_id': message.tool_call_id, 'content': message.content} | tojson + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, assistant and tool roles are supported, got ' + message.role) }}
    {%- endif %}
{%- endfor %}
"""

CONFIGS = {
    "qwen": QWEN_CONFIG,
    "llama3": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|eot_id|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "chat_template": LLAMA3,
    },
    # The list form, as some tokenizer_config.json files hold several templates.
    "mistral": {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": MISTRAL}, {"name": "rag", "template": "RAG"}],
    },
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle d'une ville ☀",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    },
]
CALL = {"id": "call0abc1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 6 times 7?"}],
    "system": [
        {"role": "system", "content": "You are a terse math tutor."},
        {"role": "user", "content": "What is 6 times 7? Café ☕"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "And half of that?"},
    ],
    "tool_use": [
        {"role": "user", "content": "What is the weather in Paris today?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call0abc1", "name": "get_weather", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
        {"role": "user", "content": "Thanks! And in Lyon?"},
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{template name: tokenizer folder} sharing one trained BPE tokenizer.json."""
    tok = train_bpe()
    out = {}
    for name, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = str(folder)
    return out


def _hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_render_and_ids_match_transformers(folders, name, conversation):
    template, tok, hf = load_chat_template(folders[name]), HFTokenizer(folders[name]), _hf(folders[name])
    messages = CONVERSATIONS[conversation]
    for add_generation_prompt in (False, True):
        for tools in (None, TOOLS):
            kw = {"add_generation_prompt": add_generation_prompt, "tools": tools}
            text = template.render(messages, **kw)
            assert text == hf.apply_chat_template(messages, tokenize=False, **kw), (add_generation_prompt, tools)
            ids = template.encode(tok, messages, **kw)
            assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
            assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_template_features_render_as_expected(folders):
    qwen = load_chat_template(folders["qwen"])
    user = CONVERSATIONS["user_only"]
    assert qwen.render(user, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = qwen.render(user, tools=TOOLS)
    assert "# Tools" in with_tools and json.dumps(TOOLS[0], ensure_ascii=False) in with_tools  # non-ASCII kept
    tool_turn = qwen.render(CONVERSATIONS["tool_use"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tool_turn
    assert "<|im_start|>user\n<tool_response>\n" in tool_turn

    llama_folder = folders["llama3"]
    llama, tok = load_chat_template(llama_folder), HFTokenizer(llama_folder)
    ids = llama.encode(tok, user, date_string="26 Jul 2024")
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # the template's bos only, none added
    text = llama.render(user, tools=TOOLS, date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024" in text and json.dumps(TOOLS[0], ensure_ascii=False, indent=4) in text
    assert llama.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

    mistral = load_chat_template(folders["mistral"])
    assert set(mistral.templates) == {"default", "rag"} and mistral.template() == MISTRAL
    with pytest.raises(ValueError, match="Only user, assistant and tool roles are supported, got critic"):
        mistral.render([{"role": "critic", "content": "x"}])


def test_template_sources_and_errors(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config {{ messages|length }}"}))
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "a"}]) == "config 1"
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0].content }}")  # wins, as in transformers
    assert load_chat_template(str(tmp_path)).render([{"role": "user", "content": "a"}]) == "file a"
    assert ChatTemplate({"default": "d", "tool_use": "t"}).render([], tools=[]) == "t"
    assert ChatTemplate({"default": "d", "tool_use": "t"}).render([]) == "d"
    # Sandboxed: no attribute escapes, no namespace dunders; HF's tojson (not HTML-escaped).
    for escape in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(ValueError, match="is unsafe"):
            ChatTemplate(escape).render([])
    with pytest.raises(ValueError, match="cannot set the namespace attribute '_x'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    assert ChatTemplate("{{ '<a & b>' | tojson }}").render([]) == '"<a & b>"'
    with pytest.raises(ValueError, match="not valid Jinja"):
        ChatTemplate("{% for %}").render([])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="No chat template in"):
        load_chat_template(str(empty))
    with pytest.raises(ValueError, match="several chat templates"):
        ChatTemplate({"a": "x", "b": "y"}).render([])


def test_missing_jinja2_names_the_extra(monkeypatch):
    import builtins

    from titanrl.models import chat_template

    real_import = builtins.__import__

    def no_jinja(name, *args, **kwargs):
        if name.startswith("jinja2"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_jinja)
    with pytest.raises(ValueError, match=r'pip install -e "\.\[chat\]"'):
        chat_template._import_jinja2()


def _runs(mask):
    """[(start, end)] of the maximal runs of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_assistant_mask_chatml_multi_turn(folders):
    template, tok = load_chat_template(folders["qwen"]), HFTokenizer(folders["qwen"])
    messages = [*CONVERSATIONS["tool_use"], {"role": "assistant", "content": "Lyon: 19 degrees, sunny."}]
    ids, mask = template.assistant_mask(tok, messages, tools=TOOLS)
    assert ids == template.encode(tok, messages, tools=TOOLS) and len(mask) == len(ids)
    text, spans = template.assistant_spans(messages, tools=TOOLS)
    # Each assistant turn's span: what the model writes after the generation prompt, end-of-turn included.
    assert [text[a:b] for a, b in spans] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "It is 21 degrees in Paris.<|im_end|>\n",
        "Lyon: 19 degrees, sunny.<|im_end|>\n",
    ]
    assert [ids[a:b] for a, b in _runs(mask)] == [tok.encode(text[a:b]) for a, b in spans]

    # Without offsets (a tokenizer that only encodes), prefix token lists give the same mask.
    class EncodeOnly:
        encode = staticmethod(tok.encode)

    assert template.assistant_mask(EncodeOnly(), messages, tools=TOOLS) == (ids, mask)


def test_assistant_mask_matches_transformers_generation_spans(folders):
    folder = folders["mistral"]
    template, tok, hf = load_chat_template(folder), HFTokenizer(folder), _hf(folder)
    messages = [*CONVERSATIONS["tool_use"], {"role": "assistant", "content": "Lyon: 19 degrees."}]
    ids, mask = template.assistant_mask(tok, messages)
    ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == ref["input_ids"] and mask == ref["assistant_masks"] and sum(mask) > 0
    # This template moves the system prompt and the tools into the last user turn: a prefix renders
    # differently, which the prefix-by-prefix mask detects instead of mis-masking.
    with pytest.raises(ValueError, match="does not render prefixes consistently at message 2"):
        template.assistant_mask(tok, [{"role": "system", "content": "Be brief."}, *messages])
    with pytest.raises(ValueError, match="does not render prefixes consistently at message 1"):
        template.assistant_mask(tok, messages, tools=TOOLS)


def test_assistant_mask_byte_tokenizer():
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [{"role": "user", "content": "hé"}, {"role": "assistant", "content": "ça va"}]
    ids, mask = template.assistant_mask(ByteTokenizer(), messages)
    masked = bytes(i for i, m in zip(ids, mask) if m).decode()
    assert masked == "ça va</>\n"


def test_real_vocabulary_size(tmp_path):
    """Qwen layout: a small BPE padded to the model's 151,936 ids, specials at Qwen's ids."""
    from titanrl.components.launch import model_args
    from titanrl.config import load_config

    write_qwen_layout_folder(tmp_path)

    titan, hf = HFTokenizer(str(tmp_path)), _hf(str(tmp_path))
    assert titan.vocab_size == len(hf) == 151936 and titan.eos_id == 151645 and titan.pad_id == 151643
    # What the tokenizer reports is checked against the model's vocab at start-up.
    assert model_args(load_config(["--model.flavor=qwen2.5-0.5b"]), titan.vocab_size).vocab_size == 151936
    template = load_chat_template(str(tmp_path))
    for messages in CONVERSATIONS.values():
        for tools in (None, TOOLS):
            ids = template.encode(titan, messages, add_generation_prompt=True, tools=tools)
            ref = hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            assert ids == ref and max(ids) == 151645 and 151644 in ids
    ids, mask = template.assistant_mask(titan, CONVERSATIONS["multi_turn"][:3])
    assert ids[-2:] == titan.encode("<|im_end|>\n") and mask[-2:] == [1, 1]

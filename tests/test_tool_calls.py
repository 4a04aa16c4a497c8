"""Tool calls in the model's own format (titanrl/envs/tool_calls.py): a table of parsing cases in
the hermes, llama3 and tag formats (malformed and partial calls included), the built-in envs
answering them, the `tools` list and 'tool' results rendered as transformers' apply_chat_template
renders them (Qwen2.5's and a Llama 3.1 mirror template), and an episode through the paged
generator whose model turn is a non-canonical BPE split: the sample holds exactly those ids."""

import dataclasses
import json
import re

import pytest
import torch

from titanrl.config.rewards_envs import Env
from titanrl.envs.builtin import CALCULATOR_TOOL, CalculatorEnv, PythonSandboxEnv
from titanrl.envs.multi_turn import tool_setup
from titanrl.envs.tool_calls import ToolCallError, parse_tool_calls, resolve_tool_format, tool_step
from titanrl.models.chat_template import ChatTemplate

NAMES = ["calculator", "search"]


class Err:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern


def hermes(*calls: str) -> str:
    return "".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


CALC = '{"name": "calculator", "arguments": {"expression": "4*37"}}'
NESTED = {"query": "paris", "filter": {"range": [1, 2.5], "tags": {"a": None, "b": [True, "x"]}}}
CASES = [
    # ---- hermes (Qwen2.5 / Qwen3 / Hermes) ----
    ("hermes", hermes(CALC), [("calculator", {"expression": "4*37"})]),
    (
        "hermes",
        hermes(CALC, '{"name": "search", "arguments": {"query": "x"}}'),
        [("calculator", {"expression": "4*37"}), ("search", {"query": "x"})],
    ),
    (
        "hermes",
        '<tool_call>{"name":"calculator","arguments":{"expression":"1"}}</tool_call>',
        [("calculator", {"expression": "1"})],
    ),
    (
        "hermes",
        '<tool_call> \t\n {"name" : "calculator" ,\n "arguments" : {}}  \n\n</tool_call>\n',
        [("calculator", {})],
    ),
    ("hermes", hermes(json.dumps({"name": "search", "arguments": NESTED})), [("search", NESTED)]),
    (
        "hermes",
        hermes('{"name": "calculator", "arguments": "{\\"expression\\": \\"3*4\\"}"}'),
        [("calculator", {"expression": "3*4"})],
    ),
    ("hermes", hermes('{"name": "search"}'), [("search", {})]),
    (
        "hermes",
        "Let me compute.\n" + hermes(CALC) + "\nthen\n" + hermes(CALC) + " done",
        [("calculator", {"expression": "4*37"})] * 2,
    ),
    ("hermes", "The answer is 148.", []),
    ("hermes", "", []),
    ("hermes", hermes('{"name": "calculator", "arguments": {"expression": "2+2"}'), Err(r"tool call 1: invalid JSON")),
    ("hermes", hermes("not json at all"), Err(r"tool call 1: invalid JSON")),
    ("hermes", "<tool_call></tool_call>", Err(r"tool call 1: invalid JSON")),
    ("hermes", hermes('{"arguments": {"expression": "1"}}'), Err(r'tool call 1: missing "name"')),
    ("hermes", hermes('{"name": 123, "arguments": {}}'), Err(r'missing "name"')),
    ("hermes", hermes('{"name": "  ", "arguments": {}}'), Err(r'missing "name"')),
    (
        "hermes",
        hermes('{"name": "calculator", "arguments": [1, 2]}'),
        Err(r'"arguments" must be a JSON object, got list'),
    ),
    (
        "hermes",
        hermes('{"name": "calculator", "arguments": "4*37"}'),
        Err(r'"arguments" is a string that is not a JSON'),
    ),
    ("hermes", hermes('["calculator", {}]'), Err(r"expected a JSON object, got list")),
    ("hermes", '<tool_call>\n{"name": "calculator", "argum', Err(r"<tool_call> without </tool_call>: .*cut off")),
    ("hermes", hermes(CALC) + "\n<tool_call>\n{", Err(r"without </tool_call>")),
    ("hermes", 'oops {"a": 1}</tool_call>', Err(r"</tool_call> without an opening <tool_call>")),
    ("hermes", "<tool_call><tool_call>" + CALC + "</tool_call>", Err(r"opened again")),
    ("hermes", hermes('{"name": "weather", "arguments": {}}'), Err(r"tool call 1: unknown tool 'weather' \(available")),
    ("hermes", hermes(CALC, '{"name": "search", "arguments": {"q": 1}'), Err(r"tool call 2: invalid JSON")),
    # ---- llama3 (Llama 3.1 / 3.2 JSON tool calls) ----
    (
        "llama3",
        '{"name": "calculator", "parameters": {"expression": "4*37"}}',
        [("calculator", {"expression": "4*37"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}}',
        [("calculator", {"expression": "1"})],
    ),
    ("llama3", 'I will use a tool.<|python_tag|>{"name": "search", "parameters": {}}', [("search", {})]),
    (
        "llama3",
        '{"name": "search", "parameters": {"query": "a"}}; {"name": "calculator", "parameters": {}}',
        [("search", {"query": "a"}), ("calculator", {})],
    ),
    ("llama3", '{"name": "search", "parameters": {}}\n{"name": "search", "parameters": {}}', [("search", {})] * 2),
    ("llama3", '{"name": "calculator", "arguments": {"expression": "2"}}', [("calculator", {"expression": "2"})]),
    (
        "llama3",
        '{"name": "calculator", "parameters": "{\\"expression\\": \\"5\\"}"}',
        [("calculator", {"expression": "5"})],
    ),
    ("llama3", "\n\n  " + json.dumps({"name": "search", "parameters": NESTED}) + "  \n", [("search", NESTED)]),
    ("llama3", "The answer is 148.", []),
    ("llama3", 'Here is JSON: {"name": "calculator", "parameters": {}}', []),
    ("llama3", '{"name": "calculator", "parameters": {"expression": 1+2}}', Err(r"tool call 1: invalid JSON")),
    ("llama3", '{"name": "calculator", "parameters": {"expr', Err(r"invalid JSON .*cut off")),
    ("llama3", '{"parameters": {}}', Err(r'tool call 1: missing "name"')),
    (
        "llama3",
        '{"name": "calculator", "parameters": 7}',
        Err(r'"parameters" or "arguments" must be a JSON object, got int'),
    ),
    (
        "llama3",
        '{"name": "calculator", "parameters": {}} Done.',
        Err(r"tool call 2: expected a JSON object, found 'Done.'"),
    ),
    ("llama3", '{"name": "weather", "parameters": {}}', Err(r"unknown tool 'weather'")),
    ("llama3", "<|python_tag|>", Err(r"without a tool call after it")),
    # ---- tag (titanrl's own) ----
    ("tag", "think <tool>4*37</tool>", [(None, {})]),
    ("tag", '<tool>{"name": "search", "arguments": {"query": "q"}}</tool>', [("search", {"query": "q"})]),
    ("tag", "<tool>1+1</tool> and <tool>2+2</tool>", [(None, {}), (None, {})]),
    ("tag", "just text", []),
    ("tag", "<tool>4*", Err(r"<tool> without </tool>: the tool call is incomplete")),
    ("tag", '<tool>{"name": </tool>', Err(r"tool call 1: invalid JSON")),
    ("tag", '<tool>{"name": "rm", "arguments": {}}</tool>', Err(r"unknown tool 'rm'")),
]


def test_the_table_covers_every_format_with_at_least_30_cases():
    assert len(CASES) >= 30
    for fmt in ("hermes", "llama3", "tag"):
        rows = [c for c in CASES if c[0] == fmt]
        assert any(isinstance(c[2], Err) for c in rows) and any(isinstance(c[2], list) and c[2] for c in rows)


@pytest.mark.parametrize("fmt,text,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_tool_calls(fmt, text, expected):
    if isinstance(expected, Err):
        with pytest.raises(ToolCallError, match=expected.pattern):
            parse_tool_calls(text, fmt, NAMES)
        return
    calls = parse_tool_calls(text, fmt, NAMES)
    assert [(c.name, c.arguments) for c in calls] == expected


def test_tag_calls_keep_their_text_and_unknown_names_pass_without_a_tool_list():
    (call,) = parse_tool_calls("<tool> 4*37 </tool>", "tag")
    assert call.name is None and call.text == " 4*37 "
    assert parse_tool_calls(hermes('{"name": "anything", "arguments": {}}'), "hermes")[0].name == "anything"
    with pytest.raises(ValueError, match="tool_format must be one of"):
        parse_tool_calls("x", "auto")


def test_builtin_envs_answer_calls_in_the_configured_format():
    env = CalculatorEnv(tool_format="hermes")
    env.reset({"prompt": "p", "answer": "148"})
    two = hermes(CALC, '{"name": "calculator", "arguments": {"expression": "1/0"}}')
    obs, reward, done, info = env.step(two)
    assert info == {"tool_call": True, "tool_results": ["148", "error"]} and (reward, done) == (0.0, False)
    assert obs == "<tool_response>\n148\n</tool_response>\n<tool_response>\nerror\n</tool_response>"
    obs, _, done, info = env.step(hermes('{"name": "calculator", "arguments": {"x": "1"}}'))
    assert info["tool_results"] == ["error: calculator takes a string argument 'expression'"] and not done
    for bad, why in [("<tool_call>{", "incomplete"), (hermes('{"name": "shell"}'), "unknown tool 'shell'")]:
        _, _, done, info = env.step(bad)
        assert info["tool_error"] and why in info["tool_results"][0] and not done
    assert env.step("148") == ("", 1.0, True, {"correct": True})
    assert CalculatorEnv().step("<tool>4*37</tool>") == ("<result>148</result>", 0.0, False, {"tool_call": True})
    python = PythonSandboxEnv(tool_format="llama3")
    python.reset({"prompt": "p", "answer": "140"})
    _, _, done, info = python.step('<|python_tag|>{"name": "python", "parameters": {"code": "sum(range(5))"}}')
    assert info["tool_results"] == ["10"] and not done
    assert python.step("140")[:3] == ("", 1.0, True)
    with pytest.raises(ValueError, match="tool_format must be one of"):
        CalculatorEnv(tool_format="xml")


def test_tool_step_without_a_call_is_none():
    assert tool_step("148", "hermes", [CALCULATOR_TOOL], lambda c: "x") is None


# ---- rendering: tools in the prompt, results as the template's tool role ----

# Llama 3.1's template, its tool sections as published (tools in the first user message by default,
# tool results as the ipython role, a string content passed through tojson).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + "}" }}
        {{- "<|eom_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
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
VOCAB = 640
LLAMA_SPECIALS = ("<|python_tag|>", "<|eot_id|>", "<|eom_id|>", "<|start_header_id|>")
LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
TOOLS = [CALCULATOR_TOOL, {"type": "function", "function": {"name": "search", "description": "Search the web."}}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{'qwen': tests/helpers/real_vocab.py's BPE with Qwen2.5's template, 'llama': the same BPE
    with the Llama 3.1 template and special tokens}: tokenizer folders."""
    pytest.importorskip("jinja2")
    pytest.importorskip("tokenizers")
    from helpers.real_vocab import QWEN_CONFIG, train_bpe

    # The BPE of the Qwen layout without its padding to 151,936 ids: a small vocabulary keeps the
    # scripted model's logits (and the test) cheap.
    qwen, llama = tmp_path_factory.mktemp("qwen"), tmp_path_factory.mktemp("llama")
    tok = train_bpe()
    llama_tok = train_bpe()
    llama_tok.add_special_tokens(["<|python_tag|>", "<|eom_id|>"])  # Llama 3.1's, for its tool calls
    for folder, bpe, config in (
        (qwen, tok, QWEN_CONFIG),
        (llama, llama_tok, {**LLAMA_TOKENS, "chat_template": LLAMA31}),
    ):
        (folder / "tokenizer.json").write_text(bpe.to_str())
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    assert llama_tok.get_vocab_size() <= VOCAB
    return {"qwen": str(qwen), "llama": str(llama)}


def _conversation(turn: str, results: list[str], final: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": "4 boxes of 37 pens. pens?"}, {"role": "assistant", "content": turn}]
    messages += [{"role": "tool", "content": r} for r in results]
    return messages + ([{"role": "assistant", "content": final}] if final is not None else [])


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_tools_and_tool_results_render_as_transformers_renders_them(folders, family):
    """ChatTurns' prompt (with `tools`) and its observation delta (two results of one turn as two
    'tool' messages) concatenate to transformers' rendering of the whole conversation."""
    transformers = pytest.importorskip("transformers")
    from titanrl.data.encode import PromptEncoder
    from titanrl.envs.multi_turn import ChatTurns
    from titanrl.models.tokenizer import HFTokenizer

    folder = folders[family]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tok, template = HFTokenizer(folder), ChatTemplate.from_folder(folder)
    turn = hermes(CALC, CALC) if family == "qwen" else '{"name": "calculator", "parameters": {"expression": "4*37"}}'
    messages = _conversation(turn, ["148", "148"])
    for with_prompt in (False, True):
        expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=with_prompt)
        assert template.render(messages, with_prompt, tools=TOOLS) == expected
    chat = ChatTurns(PromptEncoder(tok, template), "tool", TOOLS)
    prompt = chat.start([(0, 0)], messages[0]["content"])
    end_of_turn = hf.convert_tokens_to_ids("<|im_end|>" if family == "qwen" else "<|eot_id|>")
    delta = chat.observation((0, 0), "ignored", end_of_turn, ["148", "148"])
    ids = prompt + tok.encode(turn) + [end_of_turn] + delta
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok._tok.decode(ids, skip_special_tokens=False) == expected
    assert "calculator" in expected and expected.count("148") >= 2
    if family == "qwen":  # Qwen groups consecutive tool messages into one user turn
        assert expected.count("<tool_response>") == 2 and expected.count("<|im_start|>user") == 2
    else:  # Llama 3.1: one ipython message per result, a string result written as JSON
        assert expected.count('<|start_header_id|>ipython<|end_header_id|>\n\n"148"<|eot_id|>') == 2


class _RecordingPool:
    """An environment pool that answers reset with the prompt and records the text of each step."""

    def __init__(self) -> None:
        self.steps, self.results = [], []

    def reset(self, episode: int, sample: dict) -> None:
        from titanrl.envs.pool import EnvResult

        self.results.append(EnvResult(episode, "reset", sample["prompt"]))

    def step(self, episode: int, text: str) -> None:
        self.steps.append(text)

    def poll(self, block: bool) -> list:
        out, self.results = self.results, []
        return out

    def episode_tools(self, episode: int) -> None:
        return None

    def close_episode(self, episode: int) -> None:
        pass


def test_llama_python_tag_reaches_the_environment_and_eom_ends_the_turn(folders):
    """Llama 3.1 marks a call after prose with the special token <|python_tag|>, which a plain
    decode drops (the call is lost): the turn's text keeps it. A turn the model ends with
    <|eom_id|> keeps that token and the template's <|eot_id|> is dropped from the observation
    (one end of turn, the model's), unless <|eom_id|> is not an end-of-turn token of the run."""
    from titanrl.data.encode import PromptEncoder
    from titanrl.envs.multi_turn import ChatTurns, MultiTurnRollout
    from titanrl.models.tokenizer import HFTokenizer

    tok, template = HFTokenizer(folders["llama"]), ChatTemplate.from_folder(folders["llama"])
    (tag,), (eot,), (eom,), (header,) = map(tok.encode, LLAMA_SPECIALS)
    call = '{"name": "calculator", "parameters": {"expression": "4*37"}}'
    turn = tok.encode("I will use a tool.") + [tag] + tok.encode(call) + [eom]
    assert parse_tool_calls(tok.decode(turn), "llama3", NAMES) == []  # what a plain decode gives
    setup = tool_setup("calculator", "llama3", template)
    pool = _RecordingPool()
    rollout = MultiTurnRollout(
        pool,
        tok,
        4,
        400,
        prompt_encoder=PromptEncoder(tok, template),
        observation_role="tool",
        tools=setup.tools,
        keep_tokens=setup.keep_tokens,
        end_of_turn_ids=frozenset({eot, eom}),
    )
    rollout.start([{"prompt": "4 boxes of 37 pens. pens?", "answer": "148", "metadata": {}}], 1)
    rollout.submit((0, 0), turn, "stop")
    assert pool.steps == ["I will use a tool.<|python_tag|>" + call]
    ((name, arguments),) = [(c.name, c.arguments) for c in parse_tool_calls(pool.steps[0], "llama3", NAMES)]
    assert (name, arguments) == ("calculator", {"expression": "4*37"})
    for ends, first in ((frozenset({eot, eom}), header), (frozenset({eot}), eot)):
        chat = ChatTurns(PromptEncoder(tok, template), "tool", setup.tools, ends)
        chat.start([(0, 0)], "4 boxes of 37 pens. pens?")
        assert chat.observation((0, 0), "ignored", eom, ["148"])[0] == first
    chat.start([(0, 0)], "4 boxes of 37 pens. pens?")
    assert chat.observation((0, 0), "ignored", eot, ["148"])[0] == header  # as ever: eot ends the turn


def test_tool_format_auto_and_setup(folders):
    qwen, llama = (ChatTemplate.from_folder(folders[f]) for f in ("qwen", "llama"))
    assert resolve_tool_format("auto", list(qwen.templates.values())) == "hermes"
    assert resolve_tool_format("auto", list(llama.templates.values())) == "llama3"
    assert resolve_tool_format("auto", None) == "tag" and resolve_tool_format("hermes", None) == "hermes"
    with pytest.raises(ValueError, match=r"\[env\] tool_format 'auto': the chat template writes neither"):
        resolve_tool_format("auto", ["{{ messages[0].content }}"])
    setup = tool_setup("calculator", "auto", qwen)
    assert (setup.tool_format, setup.env_kwargs, setup.tools, setup.stop_strings) == (
        "hermes",
        {"tool_format": "hermes"},
        [CALCULATOR_TOOL],
        [],
    )
    tag = tool_setup("calculator", "tag", qwen)
    assert (tag.env_kwargs, tag.tools, tag.stop_strings) == ({}, None, ["</tool>"])
    with pytest.raises(ValueError, match=r"\[env\] tool_format 'llama3': the environment 'guess_number' reads only"):
        tool_setup("guess_number", "llama3", None)
    Env(tool_format="auto").validate()
    with pytest.raises(ValueError, match=re.escape("[env] tool_format must be one of")):
        Env(tool_format="json").validate()


# ---- token in, token out: an episode through the paged generator ----


def _non_canonical(tok, text: str) -> list[int]:
    """Ids that decode to `text` but are not its encoding: the longest letters-only token of the
    encoding split into one token per character."""
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    k = max(range(len(ids)), key=lambda i: len(pieces[i]) if pieces[i].isalpha() else 0)
    assert len(pieces[k]) >= 2, pieces
    split = [t for ch in pieces[k] for t in tok.encode(ch)]
    out = ids[:k] + split + ids[k + 1 :]
    assert tok.decode(out) == text and tok.encode(tok.decode(out)) != out
    return out


def test_episode_keeps_the_generated_ids_and_renders_like_transformers(folders):
    """A hermes calculator episode (two calls in one turn, then the answer) on the Qwen layout:
    the model's first turn is a non-canonical split, and the sample holds exactly those ids, the
    rendered observation after them, and is, as text, transformers' rendering of the conversation."""
    transformers = pytest.importorskip("transformers")
    from test_env_chat_template import ARGS as SHORT_ARGS
    from test_envs import ScriptedModel

    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.data.batch import build_sequence_batch
    from titanrl.data.encode import PromptEncoder
    from titanrl.envs.multi_turn import MultiTurnRollout
    from titanrl.envs.pool import EnvPool
    from titanrl.generator import Generator, SamplingParams
    from titanrl.models.tokenizer import HFTokenizer

    ARGS = dataclasses.replace(SHORT_ARGS, vocab_size=VOCAB, max_seq_len=2048)  # the tools make a long prompt
    folder = folders["qwen"]
    tok, hf = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    encoder = PromptEncoder(tok, ChatTemplate.from_folder(folder))
    turn1_text = hermes(CALC, '{"name": "calculator", "arguments": {"expression": "148+0"}}')
    turn1, turn2 = _non_canonical(tok, turn1_text), tok.encode("148")
    setup = tool_setup("calculator", "hermes", encoder.template)
    pool = EnvPool("calculator", setup.env_kwargs, num_workers=1)
    try:
        rollout = MultiTurnRollout(
            pool, tok, 4, 400, -1.0, prompt_encoder=encoder, observation_role="tool", tools=setup.tools
        )
        prompt = "4 boxes of 37 pens. pens? "
        (prompt_ids,) = rollout.start([{"prompt": prompt, "answer": "148", "metadata": {}}], 1)
        between = "\n<|im_start|>user\n<tool_response>\n148\n</tool_response>\n<tool_response>\n148\n</tool_response>"
        obs = tok.encode(between + "<|im_end|>\n<|im_start|>assistant\n")
        script = prompt_ids + turn1 + [tok.eos_id] + obs + turn2 + [tok.eos_id]
        gen = Generator(ARGS, GeneratorConfig(block_size=16, num_blocks=128), torch.device("cpu"), tokenizer=tok)
        gen.model = ScriptedModel(script, ARGS.vocab_size)
        gen.wake()
        params = SamplingParams(max_new_tokens=len(turn1) + 1, temperature=0.0, stop_strings=setup.stop_strings)
        (c,), _ = gen.generate([prompt_ids], params, turns=rollout)
    finally:
        pool.close()
    episode = rollout.episodes[(0, 0)]
    assert (episode.failed, episode.correct, episode.reward, episode.tool_calls) == (None, True, 1.0, 1)
    assert c.token_ids == turn1 + [tok.eos_id] + obs + turn2 + [tok.eos_id]  # the generated ids, as generated
    assert c.model_mask == [1] * (len(turn1) + 1) + [0] * len(obs) + [1] * (len(turn2) + 1)
    batch = build_sequence_batch([prompt_ids], [c.token_ids], tok.pad_id, [c.logprobs], [c.model_mask])
    assert batch["tokens"][0].tolist()[len(prompt_ids) : len(prompt_ids) + len(turn1)] == turn1
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": turn1_text}]
    messages += [{"role": "tool", "content": "148"}] * 2 + [{"role": "assistant", "content": "148"}]
    expected = hf.apply_chat_template(messages, tools=setup.tools, tokenize=False)
    assert tok._tok.decode(prompt_ids + c.token_ids, skip_special_tokens=False) + "\n" == expected

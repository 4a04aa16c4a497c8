"""Chat templates of Hugging Face tokenizer folders, rendered as `transformers`' `apply_chat_template` does.

A template comes from the folder's `chat_template.jinja` (and `additional_chat_templates/*.jinja`,
which, as in transformers, replace any template in the config), else from `tokenizer_config.json`'s
`chat_template`: a string, or a list of {"name", "template"} of which "default" is used ("tool_use"
when tools are given and the folder has one, as transformers picks).

Rendering uses `jinja2` (optional extra `chat`) in an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the loop-control extension, HF's `tojson` (non-ASCII kept,
optional indent), `raise_exception`, `strftime_now`, and the `{% generation %}` tag (rendered as its
body). The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the folder's
special tokens (`bos_token`, `eos_token`, ... as strings) and any extra keyword arguments, which
override them. The rendered text is encoded without adding special tokens: the template writes
its own bos.

`ChatTemplate.assistant_mask` marks the tokens of a finished conversation that the assistant
wrote. It renders prefix by prefix: for the assistant message i, the characters of
`render(messages[:i + 1])` past `render(messages[:i], add_generation_prompt=True)` are that
message's span (its content, end-of-turn marker and whatever the template writes after it, e.g.
ChatML's `<|im_end|>\\n`; not the role header, which the generation prompt holds). The whole
conversation is then encoded once, and a token is marked when it overlaps a span (token offsets
from the HF tokenizer, bytes for the byte tokenizer; any other tokenizer encodes each prefix and
must give a token prefix of the whole). This assumes the template renders prefixes consistently:
each rendered prefix is a prefix of the rendered conversation. Templates that rewrite earlier
turns (e.g. Qwen3 dropping the reasoning of past assistant turns) break that and are rejected
with an error naming the message.
"""

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime

from titanrl.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

CHAT_EXTRA = 'pip install -e ".[chat]"'
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _import_jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ValueError(f"chat templates need the 'jinja2' package (optional extra 'chat'): {CHAT_EXTRA}") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < (3, 1, 6):  # older releases have known sandbox escapes; templates are untrusted code
        raise ValueError(f"chat templates need jinja2 >= 3.1.6, found {jinja2.__version__}: {CHAT_EXTRA}")
    return jinja2


def _sandbox_types(jinja2):
    """(the `{% generation %}` extension, HF's safe `namespace`, HF's safe `dict`)."""

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-span marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore-prefixed attributes, as in transformers."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the namespace attribute {name!r}")

    class SafeDict:
        """`dict(...)` without exposing the dict type itself to the template."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    return GenerationTag, SafeNamespace, SafeDict


@functools.lru_cache(maxsize=1)
def _environment():
    """The sandbox with the globals and filters HF chat templates use, as transformers sets it up."""
    jinja2 = _import_jinja2()
    generation_tag, safe_namespace, safe_dict = _sandbox_types(jinja2)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's variant: Jinja's own filter HTML-escapes and has no indent.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[generation_tag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=safe_dict(), namespace=safe_namespace
    )
    return env


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


def _read_templates(folder: str) -> dict[str, str]:
    """{name: template} of a tokenizer folder; .jinja files win over tokenizer_config.json."""
    templates: dict[str, str] = {}
    main = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(main):
        with open(main, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates
    config = _read_tokenizer_config(folder)
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"{folder}/tokenizer_config.json: chat_template list entries must be "
                    f"{{'name': str, 'template': str}}, got {entry!r}"
                )
            templates[entry["name"]] = entry["template"]
        return templates
    if value is not None:
        raise ValueError(
            f"{folder}/tokenizer_config.json: chat_template must be a string or a list of "
            f"{{'name', 'template'}}, got {type(value).__name__}"
        )
    raise ValueError(
        f"No chat template in '{folder}': neither chat_template.jinja nor a 'chat_template' "
        "entry in tokenizer_config.json"
    )


def _read_tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg})") from None


def _special_tokens(config: dict) -> dict[str, str]:
    """The config's `*_token` entries as strings ({"content": ...} forms unwrapped), as transformers
    passes its special tokens map to the template."""
    out = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _normalize_messages(messages: Sequence[Mapping]) -> list[dict]:
    """Plain dicts without None values (many templates mishandle them), reasoning copied under
    every name templates read it by; what transformers does before rendering."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """One tokenizer folder's chat template(s) and special tokens."""

    def __init__(
        self,
        templates: str | Mapping[str, str],
        special_tokens: Mapping[str, str] | None = None,
        source: str = "<string>",
    ) -> None:
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        if not self.templates:
            raise ValueError(f"{source}: no chat template given")
        self.special_tokens = dict(special_tokens or {})
        self.source = source

    @classmethod
    def from_folder(cls, folder: str) -> "ChatTemplate":
        """The template(s) of a tokenizer folder, with the special tokens of its tokenizer_config.json."""
        if not os.path.isdir(folder):
            raise ValueError(f"'{folder}' is not a folder (expected a tokenizer folder with a chat template)")
        return cls(_read_templates(folder), _special_tokens(_read_tokenizer_config(folder)), source=folder)

    def template(self, tools: list | None = None) -> str:
        """The template used: the only one, else 'tool_use' when tools are given and it exists, else 'default'."""
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ValueError(f"{self.source}: several chat templates {sorted(self.templates)} and none named 'default'")

    def render(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """The conversation as text. `tools`: JSON-schema dicts; `kwargs` reach the template (e.g.
        `enable_thinking=False`) and override the special tokens."""
        jinja2 = _import_jinja2()
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        template = self.template(tools)
        try:
            compiled = _compile(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"chat template of {self.source} is not valid Jinja (line {e.lineno}): {e.message}"
            ) from None
        context = {**self.special_tokens, **kwargs}
        context.setdefault("documents", None)
        try:
            return compiled.render(
                messages=_normalize_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.source} failed: {e}") from None

    def encode(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> list[int]:
        """Token ids of `render(...)`; no bos is added (the template writes its own)."""
        return tokenizer.encode(self.render(messages, add_generation_prompt, tools, **kwargs))

    def assistant_spans(
        self, messages: Sequence[Mapping], tools: list[dict] | None = None, **kwargs
    ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered conversation, character span of each assistant message), prefix by prefix
        (see the module docstring); an inconsistently rendered prefix is an error naming the message."""
        messages = list(messages)
        text = self.render(messages, False, tools, **kwargs)
        spans = []
        for i, message in enumerate(messages):
            if not (isinstance(message, Mapping) and message.get("role") == "assistant"):
                continue
            before = self.render(messages[:i], True, tools, **kwargs)
            upto = text if i == len(messages) - 1 else self.render(messages[: i + 1], False, tools, **kwargs)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(
                    f"assistant_mask: the chat template of {self.source} does not render prefixes consistently at "
                    f"message {i}: the conversation rendered up to it (with a generation prompt before it) is not a "
                    "prefix of the whole, which the prefix-by-prefix mask needs (does the template rewrite earlier "
                    "turns?)"
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def assistant_mask(
        self, tokenizer: Tokenizer, messages: Sequence[Mapping], tools: list[dict] | None = None, **kwargs
    ) -> tuple[list[int], list[int]]:
        """(token ids of the whole conversation, 0/1 per token: 1 on the assistant's tokens).

        The ids are those of `encode(tokenizer, messages)`; a token is 1 when it overlaps an
        assistant span of `assistant_spans` (its content and end-of-turn marker)."""
        text, spans = self.assistant_spans(messages, tools, **kwargs)
        ids, offsets = _encode_with_offsets(tokenizer, text)
        mask = [0] * len(ids)
        if offsets is not None:
            for t, (start, end) in enumerate(offsets):
                if any(start < span_end and end > span_start for span_start, span_end in spans):
                    mask[t] = 1
            return ids, mask
        for span_start, span_end in spans:  # no offsets: encode the prefixes and diff the token lists
            lo, hi = len(tokenizer.encode(text[:span_start])), tokenizer.encode(text[:span_end])
            if ids[: len(hi)] != hi or hi[:lo] != ids[:lo]:
                raise ValueError(
                    "assistant_mask: the tokenizer does not encode the conversation's prefixes as "
                    f"token prefixes of the whole (at characters {span_start}..{span_end})"
                )
            mask[lo : len(hi)] = [1] * (len(hi) - lo)
        return ids, mask


def _encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """(ids, character span of each token), or (ids, None) for a tokenizer that has no offsets."""
    if isinstance(tokenizer, HFTokenizer):
        encoding = tokenizer._tok.encode(text, add_special_tokens=False)  # the ids HFTokenizer.encode returns
        return list(encoding.ids), [(start, end) for start, end in encoding.offsets]
    if isinstance(tokenizer, ByteTokenizer):
        offsets = [(i, i + 1) for i, ch in enumerate(text) for _ in ch.encode("utf-8")]
        return tokenizer.encode(text), offsets
    return tokenizer.encode(text), None


def load_chat_template(folder: str) -> ChatTemplate:
    """`ChatTemplate.from_folder(folder)`: e.g. the folder model.tokenizer names."""
    return ChatTemplate.from_folder(folder)

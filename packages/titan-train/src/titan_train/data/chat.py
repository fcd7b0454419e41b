"""Chat data for supervised fine-tuning: conversations rendered with a Jinja chat template, scored on the
assistant's tokens only.

Templates render as Hugging Face's `apply_chat_template` does (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, loop controls, a `tojson` filter, `raise_exception` and `strftime_now`,
and the tokenizer's special tokens as variables). The assistant's share of the text is found by rendering
prefixes: message i of the assistant spans from the end of render(messages[:i], add_generation_prompt)
to the end of render(messages[:i + 1]), its end-of-turn marker included. Templates whose earlier turns
change as the conversation grows fall back to the message's own content. Tokens are then scored when
they start inside such a span.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

# The byte tokenizer has no template of its own: role markers as plain text, each turn ended by <|end|>.
BUILTIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_blocks():
    """A Jinja extension for `{% generation %}...{% endgeneration %}`, the blocks Hugging Face templates put
    around the assistant's text: rendered as their body (the assistant's spans are found by prefixes)."""
    import jinja2.ext
    from jinja2 import nodes

    class GenerationBlocks(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlocks


def compile_template(source: str, origin: str):
    """A Jinja template compiled the way Hugging Face compiles chat templates."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_blocks()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {origin} does not compile: {e.message} (template line {e.lineno})") from None


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def read_template(spec: str, tokenizer_spec: str) -> tuple[str, str, dict[str, str]]:
    """(template source, where it came from, special tokens) for data.chat_template `spec`."""
    if spec == "builtin" or (spec == "auto" and tokenizer_spec == "byte"):
        return BUILTIN_TEMPLATE, "builtin", {}
    if spec != "auto":
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"data.chat_template: {spec!r} is neither auto, builtin nor a template file")
        return path.read_text(encoding="utf-8"), str(path), {}
    folder = Path(tokenizer_spec)
    folder = folder if folder.is_dir() else folder.parent
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    tokens = {name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), str(folder / "chat_template.jinja"), tokens
    if not isinstance(template, str):
        raise ValueError(f"data.chat_template=auto: {config_file} has no chat_template (give a template file, or "
                         "builtin)")
    return template, str(config_file), tokens


class ChatEncoder:
    """A conversation (list of {role, content}) -> (tokens, scored flags): the PackedLoader's `encode`."""

    def __init__(self, template: str, tokenizer, *, origin: str, special_tokens: dict[str, str] | None = None):
        self.template, self.origin = compile_template(template, origin), origin
        self.tokenizer, self.special_tokens = tokenizer, dict(special_tokens or {})

    @classmethod
    def build(cls, spec: str, tokenizer, *, tokenizer_spec: str) -> ChatEncoder:
        template, origin, tokens = read_template(spec, tokenizer_spec)
        return cls(template, tokenizer, origin=origin, special_tokens=tokens)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                        documents=None, **self.special_tokens)
        except TemplateError as e:
            raise ValueError(f"chat template {self.origin} does not render: {type(e).__name__}: {e}") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        text = self.render(messages)
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            span = self._prefix_span(messages, i, text)
            if span is None:  # the template rewrites earlier turns: the message's own content
                start = text.find(message["content"], cursor)
                span = None if start < 0 else (start, start + len(message["content"]))
            if span is not None:
                spans.append(span)
                cursor = span[1]
        return text, spans

    def _prefix_span(self, messages: list[dict], i: int, text: str) -> tuple[int, int] | None:
        try:
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            through = self.render(messages[:i + 1])
        except ValueError:
            return None
        if not (text.startswith(through) and through.startswith(before)) or len(through) == len(before):
            return None
        return len(before), len(through)

    def __call__(self, document) -> tuple[np.ndarray, np.ndarray]:
        text, spans = self.assistant_spans(document)
        tokens, starts = self.tokenizer.encode_with_offsets(text)
        scored = np.zeros(len(tokens), dtype=bool)
        for start, end in spans:
            scored |= (starts >= start) & (starts < end)
        # The loader's document end (not scored: the template's own end-of-turn marks the reply's end).
        return np.append(tokens, self.tokenizer.eos_id), np.append(scored, False)

    def check(self, documents, *, origin: str) -> None:
        """Every record a conversation of {role, content} strings, the first one rendered; errors name the
        record (1-based) and the source."""
        for index in range(len(documents)):
            check_conversation(documents[index], where=f"{origin}: record {index + 1}")
        if len(documents):
            try:
                self.assistant_spans(documents[0])
            except ValueError as e:
                raise ValueError(f"{e} (record 1 of {origin})") from None


def check_conversation(messages: Any, *, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: the messages must be a non-empty list of {{role, content}}, got "
                         f"{type(messages).__name__}")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {number} has no role (each message needs a string 'role' and "
                             f"'content'; got {message!r:.80})")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {number} ({message['role']}) has no string 'content'")

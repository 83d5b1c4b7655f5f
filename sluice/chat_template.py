"""A model's chat template, rendered the way Hugging Face transformers renders it.

Chat templates are Jinja programs shipped with a model (tokenizer_config.json `chat_template`, or
chat_template.jinja) and written against transformers' environment, so the same conversation must
give the same text here as `tokenizer.apply_chat_template(messages, tokenize=False)` does there:

- an immutable sandbox (templates are untrusted code), `trim_blocks` and `lstrip_blocks`, the
  `loopcontrols` extension and the `{% generation %}` block (rendered as its body);
- globals `raise_exception(message)` (a TemplateError: the conversation breaks the template's
  rules), `strftime_now(format)` (local time), `dict(...)` and `namespace(...)` (no attribute
  starting with "_");
- the `tojson` filter as json.dumps with ensure_ascii=False (Jinja's own escapes <, >, & and ');
- variables: `messages`, `tools`, `documents`, `add_generation_prompt` and the named special tokens
  (`bos_token`, `eos_token`, ...);
- messages as plain data: keys whose value is None are dropped (many templates print "None"
  otherwise), and a message's reasoning given as `reasoning_content`, `thinking` or `reasoning` is
  visible under all three names the way transformers 5 aliases them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning is passed under; templates read the first (gpt-oss reads "thinking")."""


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template refused it, or the model has no template."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing attributes that start with "_" (they reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


class _Dict:
    """`dict(...)` for templates: builds plain dicts, exposes nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def plain_data(value: Any) -> Any:
    """Return value rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple).

    Anything else becomes a "<TypeName>" placeholder, so the sandboxed template never sees an
    object with methods of its own.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return the messages as the template sees them (None values dropped, reasoning aliased).

    Raises ChatTemplateError for an empty conversation or a message that is not a mapping.
    """
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be objects, got {type(message).__name__}")
        plain = plain_data({key: item for key, item in message.items() if item is not None})
        reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


class ChatTemplate:
    """One compiled chat template and the special tokens it may print."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        """Compile source; raises ChatTemplateError when it is not valid Jinja."""
        self.source = source
        self.special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Return the prompt text of a conversation.

        Raises ChatTemplateError when the template refuses the conversation (its raise_exception,
        e.g. roles that do not alternate) or fails on it.
        """
        context = {**self.special_tokens, "messages": normalize_messages(messages),
                   "tools": plain_data(list(tools)) if tools is not None else None,
                   "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from None

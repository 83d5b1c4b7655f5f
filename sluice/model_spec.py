"""What a model directory says about serving it: length, end-of-sequence ids, BOS, defaults, chat.

Admission (tokenize, validate, apply defaults, render chats) and the worker's loader both read a
Hugging Face-style directory through `load_model_spec`, so they agree on every fact below:

- `config.json`: `max_position_embeddings` (2048 when absent), `vocab_size`, `bos_token_id`,
  `eos_token_id` (an id or a list of ids);
- `generation_config.json` (optional): more end-of-sequence ids (`eos_token_id`, an id or a list),
  and the default sampling values `temperature`, `top_p`, `top_k`, `max_new_tokens`; an explicit
  `"do_sample": false` means greedy, as in transformers;
- `tokenizer.json`, with its post-processor deciding which special tokens `encode_prompt` adds
  (e.g. Llama 3's BOS); transformers 5 does the same and ignores tokenizer_config's
  `add_bos_token` / `add_eos_token` when tokenizer.json exists. A tokenizer.json without a
  post-processor gets one from those two flags (both off when absent), as Llama tokenizers do;
- `tokenizer_config.json` (optional): the special token strings (`bos_token`, `eos_token`, ...; an
  older directory whose tokenizer_config.json has no `added_tokens_decoder` takes them from
  `special_tokens_map.json`, as transformers does) and `chat_template` (a string, or a list of
  named templates of which "default" is used); `chat_template.jinja`, when present, takes
  precedence, as in transformers.

The end-of-sequence ids are config.json's, then generation_config.json's, without repeats; when
neither names one, the tokenizer's `eos_token` (tokenizer_config.json, else "</s>").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

from sluice.chat_template import ChatTemplate, ChatTemplateError
from sluice.tokenizer import EOS_TOKEN, TextTokenizer

DEFAULT_MAX_MODEL_LEN = 2048
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers passes to a chat template (when the tokenizer has them)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values; None means "not set here" (the next source of defaults decides)."""

    temperature: float | None = None
    """0 means greedy."""
    top_p: float | None = None
    """Nucleus cut (1.0: none)."""
    top_k: int | None = None
    """Top-k cut (0: none)."""
    max_new_tokens: int | None = None
    """Output tokens when the client names no max_tokens."""

    def with_defaults(self, defaults: GenerationDefaults) -> GenerationDefaults:
        """Return these values, each unset one taken from defaults.

        E.g. `GenerationDefaults(temperature=request_temperature).with_defaults(spec.generation)`
        gives the client's value when it sent one, else the model's.
        """
        return replace(self, **{f.name: getattr(defaults, f.name) for f in fields(self)
                                if getattr(self, f.name) is None})


def read_json(path: Path, required: bool) -> dict[str, Any]:
    """Return the JSON object in path ({} when an optional file is absent).

    Raises FileNotFoundError for a required file that is absent, ValueError for one that is not a
    JSON object (naming the file).
    """
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: {path.name} not found")
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return raw


def token_ids(value: Any) -> tuple[int, ...]:
    """Return the ids of a config field that holds an id, a list of ids, or null (no ids)."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _token_string(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken object
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def generation_defaults(raw: Mapping[str, Any]) -> GenerationDefaults:
    """Return the sampling defaults of a parsed generation_config.json."""
    def number(name: str, kind: type[int] | type[float]) -> Any:
        return None if raw.get(name) is None else kind(raw[name])

    if raw.get("do_sample") is False:
        # transformers decodes greedily whatever temperature says; keep max_new_tokens
        return GenerationDefaults(temperature=0.0, max_new_tokens=number("max_new_tokens", int))
    return GenerationDefaults(number("temperature", float), number("top_p", float), number("top_k", int),
                              number("max_new_tokens", int))


def chat_template_source(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """Return the chat template of a directory (chat_template.jinja, else tokenizer_config's), or None.

    Raises ValueError for a list of named templates without a "default" one.
    """
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {str(entry.get("name")): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise ValueError(f"{model_dir}: tokenizer_config.json names chat templates {sorted(named)} "
                             "but none called 'default'")
        template = named["default"]
    return template if isinstance(template, str) else None


def load_tokenizer(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> TextTokenizer:
    """Return the tokenizer of model_dir, its post-processor set as the module docstring says.

    Raises FileNotFoundError when tokenizer.json is absent, ValueError when it cannot be parsed.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer.json not found")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: cannot parse tokenizer.json: {exc}") from None
    if tokenizer.post_processor is None:
        tokenizer.post_processor = _post_processor(tokenizer, tokenizer_config)
    return TextTokenizer(tokenizer)


def _post_processor(tokenizer: Tokenizer, tokenizer_config: Mapping[str, Any]) -> processors.TemplateProcessing:
    """The template Llama tokenizers build from add_bos_token / add_eos_token (none when both are off)."""
    added = []
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = _token_string(tokenizer_config.get(name))
        token_id = tokenizer.token_to_id(token) if token is not None else None
        added.append((token, token_id) if tokenizer_config.get(flag) and token_id is not None else None)
    bos, eos = added
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in added if t])


@dataclass(frozen=True)
class ModelSpec:
    """The model a service tokenizes for, as its directory defines it (see the module docstring)."""

    model_id: str
    """The id replicas register under (router matches on it)."""
    aliases: frozenset[str]
    """Other names a client may use ("" and the preset name, e.g. "tiny")."""
    max_model_len: int
    """Longest prompt + output, in tokens."""
    eos_token_ids: tuple[int, ...]
    """Every id that ends generation (config.json's first, then generation_config.json's)."""
    vocab_size: int
    """Ids a prompt may hold: [0, vocab_size)."""
    tokenizer: TextTokenizer = field(repr=False)
    """Encodes with the model's special tokens (see encode_prompt) and decodes."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id from config.json (what encode_prompt adds is the tokenizer's call)."""
    generation: GenerationDefaults = GenerationDefaults()
    """Default sampling values from generation_config.json."""
    chat_template: ChatTemplate | None = field(default=None, repr=False)
    """The compiled chat template, or None when the model ships none."""

    @property
    def eos_token_id(self) -> int:
        """Return the primary end-of-sequence id (the one the scheduler request carries)."""
        return self.eos_token_ids[0]

    def accepts(self, name: str) -> bool:
        """Return True when a request naming `name` is for this model."""
        return name == self.model_id or name in self.aliases

    def encode_prompt(self, text: str, release_gil: bool = False) -> list[int]:
        """Return the token ids of a completion prompt, with the special tokens the tokenizer adds (BOS).

        With release_gil, other threads run meanwhile (for a thread beside an event loop; see
        TextTokenizer.encode_releasing_gil).
        """
        if release_gil:
            return self.tokenizer.encode_releasing_gil(text, add_special_tokens=True)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Return the prompt text of a conversation, as transformers' apply_chat_template(tokenize=False).

        Raises ChatTemplateError when the model has no chat template or the template refuses the
        conversation.
        """
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.model_id!r} has no chat template")
        return self.chat_template.render(messages, add_generation_prompt, tools)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Return the token ids of a conversation (the template writes its own BOS; none is added).

        Raises ChatTemplateError as render_chat does.
        """
        return self.tokenizer.encode(self.render_chat(messages, add_generation_prompt, tools))

    def stop_token_ids(self, requested: Sequence[int] = (), ignore_eos: bool = False) -> tuple[int, ...]:
        """Return the stop ids a request should carry: its own plus the model's further EOS ids.

        The first EOS id travels as the request's eos_token_id; with ignore_eos none is added.
        """
        extra = () if ignore_eos else tuple(t for t in self.eos_token_ids[1:] if t not in requested)
        return (*requested, *extra)


def eos_ids(config: Mapping[str, Any], generation: Mapping[str, Any], tokenizer: TextTokenizer,
            tokenizer_config: Mapping[str, Any]) -> tuple[int, ...]:
    """Return the end-of-sequence ids (see the module docstring); raises ValueError when there are none."""
    ids = dict.fromkeys([*token_ids(config.get("eos_token_id")), *token_ids(generation.get("eos_token_id"))])
    if not ids:
        token = _token_string(tokenizer_config.get("eos_token")) or EOS_TOKEN
        fallback = tokenizer.token_id(token)
        if fallback is not None:
            ids[fallback] = None
    if not ids:
        raise ValueError("the model names no eos_token_id (config.json, generation_config.json) and its "
                         f"tokenizer has no {EOS_TOKEN!r}")
    return tuple(ids)


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """Return tokenizer_config.json, with special_tokens_map.json's tokens when it is the older layout.

    Raises ValueError for a file that is not a JSON object.
    """
    tokenizer_config = read_json(model_dir / "tokenizer_config.json", required=False)
    if "added_tokens_decoder" in tokenizer_config:
        return tokenizer_config
    return tokenizer_config | read_json(model_dir / "special_tokens_map.json", required=False)


def load_model_spec(model_dir: Path, model_id: str, aliases: Sequence[str] = ()) -> ModelSpec:
    """Return the ModelSpec of a Hugging Face-style directory.

    Raises FileNotFoundError for a missing config.json or tokenizer.json, ValueError (naming the
    file) for a malformed one, ChatTemplateError (a ValueError) for a template that does not compile.
    """
    config = read_json(model_dir / "config.json", required=True)
    generation = read_json(model_dir / "generation_config.json", required=False)
    tokenizer_config = read_tokenizer_config(model_dir)
    tokenizer = load_tokenizer(model_dir, tokenizer_config)
    try:
        eos = eos_ids(config, generation, tokenizer, tokenizer_config)
        bos = token_ids(config.get("bos_token_id"))
        max_len = int(config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
        vocab_size = int(config.get("vocab_size") or tokenizer.vocab_size)
        defaults = generation_defaults(generation)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{model_dir}: {exc}") from None
    source = chat_template_source(model_dir, tokenizer_config)
    special = {name: token for name in SPECIAL_TOKEN_NAMES
               if (token := _token_string(tokenizer_config.get(name))) is not None}
    template = ChatTemplate(source, special) if source is not None else None
    return ModelSpec(model_id, frozenset({"", *aliases}), max_len, eos, vocab_size, tokenizer,
                     bos[0] if bos else None, defaults, template)

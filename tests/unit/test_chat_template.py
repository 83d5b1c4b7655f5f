"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False) renders them.

The fixtures in tests/fixtures/chat_templates are the layouts of public models (Llama 3, Qwen 2.5
ChatML with tools, Mistral with its alternation check, Zephyr) plus one template exercising the
environment's features (namespace, dict, loop controls, {% generation %}, tojson options).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken

from sluice.chat_template import ChatTemplateError
from sluice.model_spec import ModelSpec, load_model_spec
from sluice.tokenizer import build_byte_tokenizer

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TEMPLATES = ("llama3", "qwen2", "mistral", "zephyr", "features")
SPECIAL = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "qwen2": (None, "<|im_end|>")}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_and_user": [{"role": "system", "content": "  You answer briefly. "},
                        {"role": "user", "content": "Hello, world?"}],
    "multi_turn": [{"role": "user", "content": 'Héllo ✓ <tag> & "quotes"'},
                   {"role": "assistant", "content": " Hi!\n"}, {"role": "user", "content": "Again\t"}],
    "tool_call": [{"role": "user", "content": "Weather in Zürich?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                      "name": "get_weather", "arguments": {"city": "Zürich", "unit": "<c>"}}}]},
                  {"role": "tool", "content": '{"temp": 21}'}],
    "user_twice": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
    "features": [{"role": "user", "content": "a <b>", "name": None},
                 {"role": "skip", "content": "hidden"},
                 {"role": "assistant", "content": "b", "reasoning": "I think"},
                 {"role": "user", "content": "c", "name": "carol"},
                 {"role": "stop", "content": "x"}, {"role": "user", "content": "never shown"}],
}


def write_model(directory: Path, template: str, in_jinja_file: bool = False) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json for a byte tokenizer with this template."""
    bos, eos = SPECIAL.get(template, ("<s>", "</s>"))
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (bos, eos) if t not in (None, "<s>", "</s>")])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    source = (FIXTURES / f"{template}.jinja").read_text()
    config: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if in_jinja_file:
        (directory / "chat_template.jinja").write_text(source)
    else:
        config["chat_template"] = source
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"vocab_size": tokenizer.get_vocab_size(),
                                                       "eos_token_id": tokenizer.token_to_id(eos)}))
    return directory


def both(spec: ModelSpec, hf: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
         tools: list[dict[str, Any]] | None) -> tuple[str, str]:
    """Render with transformers and with the spec; an error on either side is returned as "error: message"."""
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          tools=tools)
    except Exception as exc:  # the template's own refusal (TemplateError) or a failure on the input
        expected = f"error: {exc}"
    try:
        found = spec.render_chat(messages, add_generation_prompt, tools)
    except ChatTemplateError as exc:
        found = f"error: {exc}"
    return expected, found


@pytest.mark.parametrize("template", TEMPLATES)
def test_rendering_equals_transformers(template: str, tmp_path: Path) -> None:
    """Every fixture template gives transformers' text (or its error message) for every conversation, with and without a generation prompt and tools."""
    directory = write_model(tmp_path / template, template, in_jinja_file=template == "qwen2")
    spec = load_model_spec(directory, template)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    rendered = 0
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            for tools in (None, TOOLS):
                expected, found = both(spec, hf, messages, add_generation_prompt, tools)
                assert found == expected, (name, add_generation_prompt, tools)
                rendered += not expected.startswith("error: ")
    assert rendered >= 4, "each template renders several conversations, not only errors"


def test_mistral_refuses_roles_that_do_not_alternate(tmp_path: Path) -> None:
    """Mistral's raise_exception surfaces as a ChatTemplateError with the template's message, as in transformers."""
    spec = load_model_spec(write_model(tmp_path / "m", "mistral"), "m")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        spec.render_chat(CONVERSATIONS["user_twice"])
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles are supported"):
        spec.render_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    assert spec.render_chat(CONVERSATIONS["multi_turn"]).startswith("<s>[INST] Héllo")


def test_tojson_keeps_html_and_non_ascii_characters(tmp_path: Path) -> None:
    """tojson is json.dumps without ASCII or HTML escaping (Jinja's own filter would write \\u003c and \\u00e9)."""
    spec = load_model_spec(write_model(tmp_path / "q", "qwen2"), "q")
    text = spec.render_chat(CONVERSATIONS["tool_call"], tools=TOOLS)
    assert '{"city": "Zürich", "unit": "<c>"}' in text and "Weather <now> & later, in °C" in text


def test_jinja_file_takes_precedence_and_named_templates(tmp_path: Path) -> None:
    """chat_template.jinja wins over tokenizer_config's template; a list of named templates uses "default"."""
    directory = write_model(tmp_path / "z", "zephyr")
    (directory / "chat_template.jinja").write_text("{{ 'from the jinja file' }}")
    assert load_model_spec(directory, "z").render_chat([{"role": "user", "content": "x"}]) == "from the jinja file"
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_model_spec(directory, "z").render_chat([{"role": "user", "content": "x"}]) == "plain"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="none called 'default'"):
        load_model_spec(directory, "z")


def test_special_tokens_from_the_older_special_tokens_map(tmp_path: Path) -> None:
    """Without added_tokens_decoder in tokenizer_config.json, special_tokens_map.json names the tokens the template prints, as in transformers."""
    directory = write_model(tmp_path / "old", "mistral")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": None, "eos_token": None}))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
         "eos_token": "</s>"}))
    messages = CONVERSATIONS["multi_turn"]
    text = load_model_spec(directory, "old").render_chat(messages)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>[INST]") and " Hi!\n</s>" in text


def test_sandbox_and_missing_template(tmp_path: Path) -> None:
    """A template cannot reach Python internals or set underscore attributes; a model without a template says so."""
    directory = write_model(tmp_path / "s", "zephyr")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for source in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}{{ ns._x }}",
                   "{{ messages.append(1) }}"):
        (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": source}))
        with pytest.raises(ChatTemplateError):
            load_model_spec(directory, "s").render_chat([{"role": "user", "content": "x"}])
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                 if k != "chat_template"}))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_model_spec(directory, "s").render_chat([{"role": "user", "content": "x"}])


def test_tiny_preset_chats(tiny_preset: Path) -> None:
    """The tiny preset ships a chat template: turns end with its EOS token, and transformers renders it the same."""
    spec = load_model_spec(tiny_preset, "tiny")
    messages = CONVERSATIONS["multi_turn"]
    text = spec.render_chat(messages)
    assert text == ('<|user|>\nHéllo ✓ <tag> & "quotes"</s>\n<|assistant|>\n Hi!\n</s>\n<|user|>\nAgain\t</s>\n'
                    "<|assistant|>\n")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_preset))
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert spec.encode_chat(messages) == hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    with pytest.raises(ChatTemplateError, match="not tool"):
        spec.render_chat([{"role": "tool", "content": "x"}])

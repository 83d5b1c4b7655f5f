"""ModelSpec reads a model directory as the model defines it: every EOS id, BOS, generation defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from core_factories import make_core, step, token_for
from tokenizers import AddedToken, Tokenizer, processors

from admission_svc import convert as admission_convert
from sluice import convert as shared_convert
from sluice.model_spec import GenerationDefaults, ModelSpec, load_model_spec
from sluice.tokenizer import TextTokenizer, build_byte_tokenizer
from sluice.types import RequestStatus
from sluice.v1 import admission_pb2, common_pb2

BOS_TEMPLATE = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)])
LLAMA3_BOS = "<|begin_of_text|>"


def write_model(directory: Path, config: dict[str, Any] | None = None, generation: dict[str, Any] | None = None,
                tokenizer_config: dict[str, Any] | None = None, tokenizer: Tokenizer | None = None) -> Path:
    """Write a model directory (no weights: the spec does not read them) with the given JSON files."""
    directory.mkdir(parents=True, exist_ok=True)
    (tokenizer or build_byte_tokenizer()).save(str(directory / "tokenizer.json"))
    files = {"config.json": config if config is not None else {"vocab_size": 258, "eos_token_id": 257},
             "generation_config.json": generation, "tokenizer_config.json": tokenizer_config}
    for name, content in files.items():
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


def with_post_processor(post_processor: Any, *special: str) -> Tokenizer:
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in special])
    tokenizer.post_processor = post_processor
    return tokenizer


# ---- end-of-sequence ids ----------------------------------------------------------------------

def test_every_eos_id_is_kept(tmp_path: Path) -> None:
    """An eos_token_id list stays a list (Llama 3's [1, 2] is not cut to 1), generation_config's ids join it, without repeats."""
    spec = load_model_spec(write_model(tmp_path / "a", {"eos_token_id": [1, 2]}, {"eos_token_id": [2, 32]}), "a")
    assert spec.eos_token_ids == (1, 2, 32) and spec.eos_token_id == 1
    spec = load_model_spec(write_model(tmp_path / "b", {"eos_token_id": None}, {"eos_token_id": 7}), "b")
    assert spec.eos_token_ids == (7,)


def test_eos_falls_back_to_the_tokenizers_eos_token(tmp_path: Path) -> None:
    """With no EOS id in config or generation config, the tokenizer's eos_token (tokenizer_config, else "</s>") is used; none at all is an error."""
    assert load_model_spec(write_model(tmp_path / "a", {}), "a").eos_token_ids == (257,)
    spec = load_model_spec(write_model(tmp_path / "b", {}, tokenizer_config={"eos_token": {"content": "<s>"}}), "b")
    assert spec.eos_token_ids == (256,)
    with pytest.raises(ValueError, match="names no eos_token_id"):
        load_model_spec(write_model(tmp_path / "c", {}, tokenizer_config={"eos_token": "<none>"},
                                    tokenizer=Tokenizer.from_str(_without_eos())), "c")


def _without_eos() -> str:
    raw = json.loads(build_byte_tokenizer().to_str())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != "</s>"]
    return json.dumps(raw)


@pytest.mark.parametrize(("ignore_eos", "stop_at", "status"),
                         [(False, 2, RequestStatus.FINISHED_STOP), (True, 7, RequestStatus.FINISHED_LENGTH)])
def test_a_later_eos_id_ends_generation(tmp_path: Path, ignore_eos: bool, stop_at: int, status: RequestStatus) -> None:
    """Admission's Submit carries the first EOS id and the others as stop ids, so the scheduler core stops at any of them (unless ignore_eos)."""
    spec = load_model_spec(write_model(tmp_path / "m", {"eos_token_id": [token_for("r", 5), token_for("r", 2)]}), "m")
    request = admission_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
        max_tokens=8, stop_token_ids=[3], ignore_eos=ignore_eos))
    submit = admission_convert.submit_request("r", "t", [1, 2, 3, 4], admission_convert.generate_call(request),
                                              "owner", 0.0, spec,
                                              common_pb2.LifecycleTimestamps(), 1.0)
    assert submit.eos_token_id == token_for("r", 5)
    assert list(submit.sampling.stop_token_ids) == ([3] if ignore_eos else [3, token_for("r", 2)])
    core = make_core()
    core.submit(shared_convert.new_request_from_proto(submit, 0.0, default_eos=spec.eos_token_id), 0.0)
    finished = []
    for now in range(10):
        finished += step(core, float(now))[1].finished
    (record,) = finished
    assert record.status is status and len(record.output_token_ids) == stop_at + 1


# ---- BOS and special tokens -------------------------------------------------------------------

def test_prompts_get_bos_as_the_tokenizer_defines_it(tmp_path: Path) -> None:
    """encode_prompt adds what tokenizer.json's post-processor adds (Llama 3 BOS, Llama 2 <s>, nothing for ByteLevel), equal to transformers."""
    transformers = pytest.importorskip("transformers")
    llama3 = processors.TemplateProcessing(single=f"{LLAMA3_BOS} $A", pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B",
                                           special_tokens=[(LLAMA3_BOS, 258)])
    cases = {
        "llama3": (with_post_processor(llama3, LLAMA3_BOS), {"bos_token": LLAMA3_BOS}, [258, 104, 105]),
        "llama2": (with_post_processor(BOS_TEMPLATE), {"bos_token": "<s>", "add_bos_token": True}, [256, 104, 105]),
        # transformers 5 ignores add_bos_token when tokenizer.json exists: its post-processor decides
        "flag_off": (with_post_processor(BOS_TEMPLATE), {"bos_token": "<s>", "add_bos_token": False}, [256, 104, 105]),
        "qwen2": (with_post_processor(processors.ByteLevel(trim_offsets=False)), {"bos_token": None}, [104, 105]),
        "none": (build_byte_tokenizer(), {}, [104, 105]),
    }
    for name, (tokenizer, tokenizer_config, expected) in cases.items():
        directory = write_model(tmp_path / name, tokenizer_config=tokenizer_config | {
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{{ bos_token }}{{ messages[0].content }}"},
            tokenizer=tokenizer)
        spec = load_model_spec(directory, name)
        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
        assert spec.encode_prompt("hi") == hf("hi").input_ids == expected, name
        assert spec.tokenizer.encode("hi") == [104, 105], "plain encode adds nothing"
        chat = [{"role": "user", "content": "hi"}]
        assert spec.encode_chat(chat) == hf.apply_chat_template(chat)["input_ids"], f"{name}: one BOS, from the template"


def test_bos_from_the_config_flags_when_tokenizer_json_has_no_post_processor(tmp_path: Path) -> None:
    """A tokenizer.json without a post-processor adds BOS/EOS as tokenizer_config's add_bos_token / add_eos_token say (none when absent)."""
    flags = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}
    spec = load_model_spec(write_model(tmp_path / "both", tokenizer_config=flags), "both")
    assert spec.encode_prompt("hi") == [256, 104, 105, 257]
    spec = load_model_spec(write_model(tmp_path / "bos", tokenizer_config=flags | {"add_eos_token": False}), "bos")
    assert spec.encode_prompt("hi") == [256, 104, 105]
    spec = load_model_spec(write_model(tmp_path / "off", tokenizer_config={"bos_token": "<s>"}), "off")
    assert spec.encode_prompt("hi") == [104, 105]


def test_tiny_preset_prompts_are_unchanged(tiny_preset: Path) -> None:
    """The tiny preset adds no BOS (add_bos_token false), so its prompts keep the ids every other test expects."""
    spec = load_model_spec(tiny_preset, "tiny")
    assert spec.encode_prompt("hi") == [104, 105] and spec.bos_token_id == 256 and spec.eos_token_ids == (257,)


# ---- generation defaults ----------------------------------------------------------------------

def test_generation_defaults_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """temperature, top_p, top_k and max_new_tokens come from generation_config.json (the values transformers reads); absent ones stay unset."""
    transformers = pytest.importorskip("transformers")
    directory = write_model(tmp_path / "g", generation={"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                                       "top_k": 20, "max_new_tokens": 64, "eos_token_id": [257]})
    defaults = load_model_spec(directory, "g").generation
    hf = transformers.GenerationConfig.from_pretrained(str(directory))
    assert defaults == GenerationDefaults(0.6, 0.9, 20, 64)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_new_tokens) == (
        hf.temperature, hf.top_p, hf.top_k, hf.max_new_tokens)
    assert load_model_spec(write_model(tmp_path / "none"), "none").generation == GenerationDefaults()
    partial = load_model_spec(write_model(tmp_path / "p", generation={"temperature": 0.7}), "p").generation
    assert partial == GenerationDefaults(temperature=0.7)


def test_do_sample_false_means_greedy(tmp_path: Path) -> None:
    """An explicit do_sample false makes the default greedy whatever temperature says (transformers ignores it too)."""
    spec = load_model_spec(write_model(tmp_path / "g", generation={"do_sample": False, "temperature": 0.6,
                                                                   "top_p": 0.9, "max_new_tokens": 32}), "g")
    assert spec.generation == GenerationDefaults(temperature=0.0, max_new_tokens=32)


def test_client_values_win_over_model_defaults() -> None:
    """with_defaults keeps every value the client set and fills the others from the model, then from a fallback."""
    model = GenerationDefaults(temperature=0.6, top_p=0.9, max_new_tokens=64)
    client = GenerationDefaults(temperature=0.0, top_k=5)
    fallback = GenerationDefaults(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
    assert client.with_defaults(model).with_defaults(fallback) == GenerationDefaults(0.0, 0.9, 5, 64)
    assert GenerationDefaults().with_defaults(fallback) == fallback


# ---- a directory transformers wrote -----------------------------------------------------------

def test_directory_written_by_transformers(tmp_path: Path) -> None:
    """config, generation config and tokenizer saved by transformers give every EOS id, the defaults and the chat template."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf"
    transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=512, bos_token_id=256,
                             eos_token_id=[1, 2]).save_pretrained(directory)
    transformers.GenerationConfig(bos_token_id=256, eos_token_id=[1, 2, 257], do_sample=True, temperature=0.6,
                                  top_p=0.9).save_pretrained(directory)
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    transformers.PreTrainedTokenizerFast(tokenizer_object=with_post_processor(BOS_TEMPLATE), bos_token="<s>",
                                         eos_token="</s>", chat_template=template).save_pretrained(directory)
    spec = load_model_spec(directory, "hf")
    assert (spec.eos_token_ids, spec.bos_token_id, spec.max_model_len, spec.vocab_size) == ((1, 2, 257), 256, 512, 258)
    assert spec.generation == GenerationDefaults(temperature=0.6, top_p=0.9)
    assert spec.encode_prompt("hi") == [256, 104, 105]
    assert spec.render_chat([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s>"


def test_model_spec_without_template_or_extras(tmp_path: Path) -> None:
    """A spec built directly (as tests and tools do) has no template and no further EOS ids to add."""
    spec = ModelSpec("m", frozenset({""}), 64, (257,), 258, TextTokenizer(build_byte_tokenizer()))
    assert spec.stop_token_ids((5,)) == (5,) and spec.accepts("") and spec.accepts("m") and not spec.accepts("x")

"""The loader reads Hugging Face-style Llama directories and names exactly what is wrong with a bad one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_svc.engine.errors import ModelLoadError
from worker_svc.engine.loader import load_model
from worker_svc.engine.model import reference_forward
from worker_svc.engine.presets import PRESETS, random_weights, write_preset

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def model_dir(tiny_preset: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny preset, for tests that break it."""
    return Path(shutil.copytree(tiny_preset, tmp_path / "model"))


def edit_config(model_dir: Path, **changes: object) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def edit_weights(model_dir: Path, edit) -> None:  # type: ignore[no-untyped-def]
    weights = load_file(str(model_dir / "model.safetensors"))
    edit(weights)
    save_file(weights, str(model_dir / "model.safetensors"))


def expect_error(model_dir: Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir, device="cpu", dtype="float32")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_preset_directory_loads_and_runs(model_dir: Path) -> None:
    """A written tiny preset loads on the CPU in float32 and produces finite logits of the vocabulary's width."""
    loaded = load_model(model_dir, device="cpu", dtype="auto")
    assert loaded.dtype == torch.float32 and loaded.config == PRESETS["tiny"]
    logits = reference_forward(loaded.model, torch.tensor([1, 2, 3]))
    assert logits.shape == (3, 258) and torch.isfinite(logits).all()


def test_missing_directory(tmp_path: Path) -> None:
    """A directory that does not exist is reported by path."""
    expect_error(tmp_path / "nope", "does not exist")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(model_dir: Path, name: str) -> None:
    """Each required file, when missing, is named in the error."""
    (model_dir / name).unlink()
    expect_error(model_dir, "config.json not found" if name == "config.json" else name.split(".")[-1])


def test_other_architecture_is_named(model_dir: Path) -> None:
    """A config for another architecture is refused with the architecture and model type found."""
    edit_config(model_dir, architectures=["MistralForCausalLM"], model_type="mistral")
    expect_error(model_dir, "LlamaForCausalLM", "MistralForCausalLM", "'mistral'")


def test_unsupported_feature_is_named(model_dir: Path) -> None:
    """A config asking for a rope scaling the engine lacks (yarn), or an incomplete llama3 one, is refused rather than ignored."""
    edit_config(model_dir, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    expect_error(model_dir, "rope scaling", "yarn")
    edit_config(model_dir, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    expect_error(model_dir, "llama3 rope scaling lacks 'low_freq_factor'")


def test_missing_tensor_is_named(model_dir: Path) -> None:
    """A checkpoint without one layer's weight names that tensor."""
    edit_weights(model_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(model_dir, "missing tensors", "model.layers.1.mlp.up_proj.weight")


def test_unexpected_tensor_is_named(model_dir: Path) -> None:
    """A checkpoint with an extra tensor names it instead of ignoring it."""
    edit_weights(model_dir, lambda w: w.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    expect_error(model_dir, "unexpected tensors", "model.layers.9.extra.weight")


def test_shape_mismatch_names_tensor_and_shapes(model_dir: Path) -> None:
    """A tensor of the wrong shape is reported with its name, the shape found and the shape expected."""
    edit_weights(model_dir, lambda w: w.update({"model.norm.weight": torch.ones(64)}))
    expect_error(model_dir, "'model.norm.weight'", "[64]", "[128]")


def test_unsupported_dtype_is_named(model_dir: Path) -> None:
    """A tensor stored as int8 is refused with its name and dtype."""
    edit_weights(model_dir, lambda w: w.update({"model.norm.weight": torch.ones(128, dtype=torch.int8)}))
    expect_error(model_dir, "'model.norm.weight'", "I8")


def test_unknown_dtype_and_device_options_are_refused(model_dir: Path) -> None:
    """An unknown dtype or device name is refused with the accepted names."""
    with pytest.raises(ModelLoadError, match="float32"):
        load_model(model_dir, device="cpu", dtype="int4")
    with pytest.raises(ModelLoadError, match="cpu, cuda"):
        load_model(model_dir, device="tpu")


def test_sharded_checkpoint_with_index_loads_the_same_model(model_dir: Path, tiny_preset: Path) -> None:
    """Weights split over two files with a model.safetensors.index.json load to the same logits; a missing shard is named."""
    weights = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, members in shards.items():
        save_file({n: weights[n] for n in members}, str(model_dir / file))
        weight_map.update({n: file for n in members})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = torch.tensor([5, 6, 7, 8])
    sharded = reference_forward(load_model(model_dir, "cpu", "float32").model, ids)
    single = reference_forward(load_model(tiny_preset, "cpu", "float32").model, ids)
    assert torch.equal(sharded, single)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    expect_error(model_dir, "missing", "model-00002-of-00002.safetensors")


def test_tied_embeddings_share_one_matrix(tmp_path: Path) -> None:
    """With tie_word_embeddings the checkpoint has no lm_head and the loaded output projection is the embedding."""
    config = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    write_preset(tmp_path, "tiny")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file(random_weights(config, 0), str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path, "cpu", "float32")
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_bfloat16_compute_dtype(model_dir: Path) -> None:
    """dtype=bfloat16 loads every parameter as bfloat16 and still gives finite logits."""
    loaded = load_model(model_dir, "cpu", "bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert torch.isfinite(reference_forward(loaded.model, torch.tensor([1, 2]))).all()


def test_transformers_5_rope_parameters_are_read(model_dir: Path) -> None:
    """A config in the transformers 5 layout (rope base inside rope_parameters) loads with that base; a scaled rope type is refused."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("rope_theta")
    raw.pop("rope_scaling")
    path.write_text(json.dumps(raw | {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}))
    assert load_model(model_dir, "cpu", "float32").config.rope_theta == 500000.0
    path.write_text(
        json.dumps(raw | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}})
    )
    expect_error(model_dir, "rope scaling", "yarn")


def test_hugging_face_checkpoint_gives_hugging_face_logits(tmp_path: Path) -> None:
    """A directory written by transformers' LlamaForCausalLM.save_pretrained (GQA, sharded, tied, llama3 RoPE scaling) loads and reproduces its logits within 1e-4."""
    transformers = pytest.importorskip("transformers")
    from sluice.tokenizer import build_byte_tokenizer

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    for tied, scaling in ((False, None), (True, llama3)):
        config = transformers.LlamaConfig(
            vocab_size=258, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0, tie_word_embeddings=tied,
            rms_norm_eps=1e-6, **({"rope_parameters": scaling} if scaling else {}),
        )  # fmt: skip
        torch.manual_seed(0)
        hf_model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for parameter in hf_model.parameters():
                parameter.normal_(0, 0.3)  # large weights, so any convention mismatch shows
        target = tmp_path / f"hf-{tied}"
        hf_model.save_pretrained(target, max_shard_size="200KB")
        build_byte_tokenizer().save(str(target / "tokenizer.json"))
        ids = torch.tensor(
            list(b"Hugging Face checkpoint parity, long enough for low RoPE frequencies. " * 3)
        )
        with torch.no_grad():
            expected = hf_model(ids[None]).logits[0].float()
        found = reference_forward(load_model(target, "cpu", "float32").model, ids)
        torch.testing.assert_close(found, expected, atol=1e-4, rtol=0)


def test_config_defaults_and_token_id_lists() -> None:
    """Config parsing keeps a BOS id of 0, takes the first of a Llama 3 EOS list and uses HF's defaults for absent fields."""
    from worker_svc.engine.config import LlamaConfig

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    config = LlamaConfig.from_hf_dict(base | {"bos_token_id": 0, "eos_token_id": [5, 6]})
    assert (config.bos_token_id, config.eos_token_id) == (0, 5)
    config = LlamaConfig.from_hf_dict(base | {"bos_token_id": None})
    assert (config.bos_token_id, config.eos_token_id, config.num_key_value_heads, config.head_dim) == (
        1,
        2,
        2,
        4,
    )
    assert (config.rms_norm_eps, config.rope_theta, config.rope_llama3) == (1e-6, 10000.0, None)
    with pytest.raises(ModelLoadError, match="'num_hidden_layers' is missing"):
        LlamaConfig.from_hf_dict({k: v for k, v in base.items() if k != "num_hidden_layers"})


def test_worker_and_admission_read_the_model_the_same_way(model_dir: Path) -> None:
    """The loader and load_model_spec agree on EOS ids (a list, plus generation_config's), BOS, length, vocabulary and prompt ids."""
    from tokenizers import Tokenizer, processors

    from sluice.model_spec import load_model_spec

    edit_config(model_dir, eos_token_id=[257, 10], max_position_embeddings=1024)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 33], "temperature": 0.5}))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    loaded = load_model(model_dir, "cpu", "float32")
    spec = load_model_spec(model_dir, "m")
    assert loaded.spec.eos_token_ids == spec.eos_token_ids == (257, 10, 33)
    assert loaded.config.eos_token_id == spec.eos_token_id == 257 and loaded.config.bos_token_id == spec.bos_token_id
    assert loaded.config.max_position_embeddings == spec.max_model_len == 1024
    assert loaded.config.vocab_size == spec.vocab_size and loaded.spec.generation == spec.generation
    assert loaded.tokenizer.encode("hi", add_special_tokens=True) == spec.encode_prompt("hi") == [256, 104, 105]


def test_worker_eos_without_config_id_is_admissions(model_dir: Path) -> None:
    """With no eos_token_id in config.json, the worker takes the same fallback as admission (the tokenizer's </s>), not Llama's 2."""
    from sluice.model_spec import load_model_spec

    path = model_dir / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "eos_token_id"}))
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir, "cpu", "float32").config.eos_token_id == load_model_spec(model_dir, "m").eos_token_id == 257
